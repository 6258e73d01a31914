//! The embedded default corpus: multi-digit addition, generated from a seed.
//!
//! Owns the problem distribution, the train/held-out split, the text format
//! and exact-match scoring. A line is `347+085=2340\n`: operands zero-padded
//! to three digits, the sum zero-padded to four and written least-significant
//! digit first — the order a person adds in, carrying right to left, so each
//! answer digit depends only on digits already seen. Small transformers learn
//! this format from far fewer examples than the usual order (Lee et al., 2023,
//! "Teaching Arithmetic to Small Transformers"); fixed widths line the digits
//! up. One byte per token, vocab 256, every line 13 bytes.
//! Must never let a held-out problem into the training tokens: the split is a
//! fixed hash of the problem itself, so it holds for every seed and every
//! corpus size, and the held-out accuracy measures generalisation rather than
//! recall. Never reads files or draws randomness outside `rng::Rng`.
//!
//! Only addition is generated: subtraction would double what the small default
//! model must learn in its 1500 steps, and addition with carries is already a
//! task where memorising is not enough.

use super::token_file::DataError;
use crate::rng::{mix64, Purpose, Rng};

/// Vocabulary of the generated corpus: bytes.
pub const VOCAB_SIZE: usize = 256;
/// Every line's length, `999+999=8991\n`; an eval window must hold at least one.
pub const MAX_LINE_LEN: usize = 13;
/// Share of all problems (in percent) that are held out of training.
pub const HELD_OUT_PERCENT: u64 = 10;

/// Salt of the split hash. Deliberately not the run seed: the held-out set is
/// the same for every run, so accuracies of different seeds are comparable.
const SPLIT_SALT: u64 = 0x5EED_A1D5_0FA1_1ED5;
/// Distinguishes this corpus's random streams from other `Purpose::Data` users.
const STREAM: u64 = 0xa417;
const TRAIN_STREAM: u64 = 0;
const VAL_STREAM: u64 = 1;
const EVAL_STREAM: u64 = 2;

/// One problem `a + b`, both operands with 1 to 3 digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Problem {
    pub a: u32,
    pub b: u32,
}

impl Problem {
    /// Operand lengths are drawn uniformly from 1..=3 digits first, so short
    /// numbers are as common as long ones (uniform values in 0..1000 would
    /// make 90% of operands three digits long).
    fn random(rng: &mut Rng) -> Problem {
        let operand = |rng: &mut Rng| {
            let digits = 1 + rng.below(3) as u32;
            let lo = if digits == 1 { 0 } else { 10u32.pow(digits - 1) };
            let hi = 10u32.pow(digits);
            lo + rng.below((hi - lo) as u64) as u32
        };
        let a = operand(rng);
        let b = operand(rng);
        Problem { a, b }
    }

    pub fn answer(&self) -> u32 {
        self.a + self.b
    }

    /// The problem as its text line: `aaa+bbb=cccc\n`, the sum reversed.
    pub fn line(&self) -> String {
        let sum: String = format!("{:04}", self.answer()).chars().rev().collect();
        format!("{:03}+{:03}={sum}\n", self.a, self.b)
    }

    /// Whether the problem belongs to the held-out set: a hash of the
    /// (a, op, b) triple, independent of any seed.
    pub fn is_held_out(&self) -> bool {
        let mut h = mix64(SPLIT_SALT);
        for x in [self.a as u64, b'+' as u64, self.b as u64] {
            h = mix64(h ^ x);
        }
        h % 100 < HELD_OUT_PERCENT
    }

    /// Parses a line `aaa+bbb=cccc` (without the newline, the sum reversed);
    /// `None` unless it is a well-formed problem with the right answer.
    pub fn parse(line: &str) -> Option<Problem> {
        let (lhs, c) = line.split_once('=')?;
        let (a, b) = lhs.split_once('+')?;
        let digits = |s: &str, n: usize| -> Option<u32> {
            if s.len() != n || !s.bytes().all(|c| c.is_ascii_digit()) {
                return None;
            }
            s.parse().ok()
        };
        let p = Problem { a: digits(a, 3)?, b: digits(b, 3)? };
        let c: String = c.chars().rev().collect();
        (digits(&c, 4)? == p.answer()).then_some(p)
    }
}

/// An endless stream of problems from one side of the split.
fn problems(seed: u64, stream: u64, held_out: bool) -> impl Iterator<Item = Problem> {
    let mut rng = Rng::new(seed, Purpose::Data, &[STREAM, stream]);
    std::iter::repeat_with(move || Problem::random(&mut rng)).filter(move |p| p.is_held_out() == held_out)
}

/// Lines in the training text. Its length never follows `train.steps`, so a
/// sequence's tokens depend on the seed and its global index alone (a 2-step
/// run resumed to 3 reads what a 3-step run reads). 2^21 lines are 27M tokens,
/// nine times the default run's 3.1M; nothing is stored, so size costs only
/// the shuffled sampler's permutation (4 bytes a window).
pub const TRAIN_LINES: usize = 1 << 21;

/// The training text as a function of (seed, position): line k is the first
/// training-side problem drawn from a stream keyed by k, so any window is
/// generated on demand, in any order, without the lines before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrainText {
    seed: u64,
}

impl TrainText {
    pub fn new(seed: u64) -> TrainText {
        TrainText { seed }
    }

    /// Tokens in the text: `TRAIN_LINES` lines of `MAX_LINE_LEN` bytes.
    pub fn len(&self) -> usize {
        TRAIN_LINES * MAX_LINE_LEN
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The problem on line `k`.
    pub fn problem(&self, k: usize) -> Problem {
        let mut rng = Rng::new(self.seed, Purpose::Data, &[STREAM, TRAIN_STREAM, k as u64]);
        loop {
            let p = Problem::random(&mut rng);
            if !p.is_held_out() {
                return p;
            }
        }
    }

    /// Copies tokens `[start, start + out.len())` into `out`; panics past the end.
    pub fn window(&self, start: usize, out: &mut [u32]) {
        assert!(start + out.len() <= self.len(), "window past the arithmetic text's {} tokens", self.len());
        let mut done = 0;
        while done < out.len() {
            let at = start + done;
            let (k, offset) = (at / MAX_LINE_LEN, at % MAX_LINE_LEN);
            let line = self.problem(k).line();
            let n = (MAX_LINE_LEN - offset).min(out.len() - done);
            for (o, b) in out[done..done + n].iter_mut().zip(&line.as_bytes()[offset..offset + n]) {
                *o = *b as u32;
            }
            done += n;
        }
    }
}

/// Whole lines from `problems` until at least `n_tokens` bytes.
fn lines_to_tokens(problems: impl Iterator<Item = Problem>, n_tokens: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(n_tokens + MAX_LINE_LEN);
    for p in problems {
        if out.len() >= n_tokens {
            break;
        }
        out.extend(p.line().bytes().map(|b| b as u32));
    }
    out
}

/// The generated train and validation tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArithmeticCorpus {
    /// Training problems only; at least `n_train_tokens` tokens, whole lines:
    /// the start of `TrainText`.
    pub train: Vec<u32>,
    /// Held-out problems only, same format; at least `n_val_tokens` (and at
    /// least 4096) tokens, for validation loss.
    pub val: Vec<u32>,
}

impl ArithmeticCorpus {
    /// Deterministic in `seed`; a larger `n_train_tokens` or `n_val_tokens`
    /// extends the same stream of problems rather than drawing a new one.
    pub fn generate(seed: u64, n_train_tokens: usize, n_val_tokens: usize) -> ArithmeticCorpus {
        let text = TrainText::new(seed);
        let lines = n_train_tokens.div_ceil(MAX_LINE_LEN).min(TRAIN_LINES);
        let train = (0..lines).flat_map(|k| text.problem(k).line().into_bytes()).map(u32::from).collect();
        let val = lines_to_tokens(problems(seed, VAL_STREAM, true), n_val_tokens.max(4096));
        ArithmeticCorpus { train, val }
    }
}

/// Where one problem's answer is scored: input positions
/// `start .. start + len` of window `window`, whose next-token targets are the
/// answer's digits and the newline after them (`start` is the `=` sign).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnswerSpan {
    pub window: usize,
    pub start: usize,
    pub len: usize,
}

/// Held-out problems packed into windows, scored by exact match.
///
/// Teacher-forced exact match equals greedy-decoding exact match: the model
/// is fed the true prefix (problem, `=`, the answer digits so far) and a
/// problem counts only if the argmax at every answer position is the true next
/// token. If that holds, greedy decoding from `a+b=` produces the first digit
/// correctly, so its prefix is the true prefix again, and by induction it
/// writes the whole answer and the newline exactly. Conversely, if greedy
/// decoding writes the answer exactly, every prefix it conditioned on was the
/// true one, so every teacher-forced argmax was correct. Scoring the newline
/// makes an answer that runs on fail. So one forward pass over these
/// windows gives generation accuracy without a decoding loop.
#[derive(Clone, Debug)]
pub struct EvalSet {
    block_size: usize,
    n_windows: usize,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    spans: Vec<AnswerSpan>,
}

impl EvalSet {
    /// `n_windows` windows of T+1 tokens of held-out problems, drawn from
    /// `seed`. Fails when a window cannot hold the longest line.
    pub fn new(seed: u64, block_size: usize, n_windows: usize) -> Result<EvalSet, DataError> {
        EvalSet::pack(block_size, n_windows, problems(seed, EVAL_STREAM, true))
    }

    /// Packs whole lines into windows of T+1 tokens, padding each window's
    /// tail with newlines; a line that does not fit starts the next window.
    fn pack(
        block_size: usize,
        n_windows: usize,
        problems: impl IntoIterator<Item = Problem>,
    ) -> Result<EvalSet, DataError> {
        if block_size + 1 < MAX_LINE_LEN {
            return Err(DataError::BadShape {
                name: "arithmetic eval set".into(),
                what: format!(
                    "block_size {block_size} is too short; a window of T+1 tokens must hold a \
                     {MAX_LINE_LEN}-byte line, so expected T >= {}",
                    MAX_LINE_LEN - 1
                ),
            });
        }
        let w = block_size + 1;
        let mut windows: Vec<Vec<u8>> = Vec::with_capacity(n_windows);
        let mut spans = Vec::new();
        let mut current: Vec<u8> = Vec::with_capacity(w);
        let mut problems = problems.into_iter();
        while windows.len() < n_windows {
            let Some(p) = problems.next() else { break };
            let line = p.line();
            if current.len() + line.len() > w {
                current.resize(w, b'\n');
                windows.push(std::mem::replace(&mut current, Vec::with_capacity(w)));
                if windows.len() == n_windows {
                    break;
                }
            }
            let eq = line.find('=').expect("a problem line has '='");
            spans.push(AnswerSpan {
                window: windows.len(),
                start: current.len() + eq,
                // The answer digits plus the newline.
                len: line.len() - eq - 1,
            });
            current.extend_from_slice(line.as_bytes());
        }
        if windows.len() < n_windows && !current.is_empty() {
            current.resize(w, b'\n');
            windows.push(current);
        }
        // A finite problem list may fill fewer windows than asked for.
        let n_windows = windows.len();
        let mut inputs = Vec::with_capacity(n_windows * block_size);
        let mut targets = Vec::with_capacity(n_windows * block_size);
        for win in &windows {
            inputs.extend(win[..block_size].iter().map(|&b| b as u32));
            targets.extend(win[1..].iter().map(|&b| b as u32));
        }
        Ok(EvalSet { block_size, n_windows, inputs, targets, spans })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_windows(&self) -> usize {
        self.n_windows
    }

    /// (n_windows, T) row-major model inputs.
    pub fn inputs(&self) -> &[u32] {
        &self.inputs
    }

    /// (n_windows, T) next-token targets, for the loss.
    pub fn targets(&self) -> &[u32] {
        &self.targets
    }

    /// One span per problem, in window order.
    pub fn spans(&self) -> &[AnswerSpan] {
        &self.spans
    }

    /// `predictions` are the model's argmax at each input position, laid out
    /// like `inputs()`. Returns (problems whose every answer target was
    /// predicted, problems).
    pub fn exact_match(&self, predictions: &[u32]) -> (usize, usize) {
        assert_eq!(
            predictions.len(),
            self.inputs.len(),
            "predictions must be n_windows * T = {} * {}",
            self.n_windows,
            self.block_size
        );
        let correct = self
            .spans
            .iter()
            .filter(|s| {
                let at = s.window * self.block_size + s.start;
                predictions[at..at + s.len] == self.targets[at..at + s.len]
            })
            .count();
        (correct, self.spans.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn lines(tokens: &[u32]) -> Vec<String> {
        let text: String = tokens.iter().map(|&t| t as u8 as char).collect();
        assert!(text.ends_with('\n'), "corpus should end with a whole line");
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn held_out_problems_never_appear_in_train() {
        let c = ArithmeticCorpus::generate(1337, 300_000, 30_000);
        let train: BTreeSet<Problem> = lines(&c.train)
            .iter()
            .map(|l| Problem::parse(l).unwrap_or_else(|| panic!("bad train line {l:?}")))
            .collect();
        let val: BTreeSet<Problem> = lines(&c.val).iter().map(|l| Problem::parse(l).unwrap()).collect();
        assert!(train.iter().all(|p| !p.is_held_out()));
        assert!(val.iter().all(|p| p.is_held_out()));
        assert!(train.is_disjoint(&val));
        let eval = EvalSet::new(1337, 64, 64).unwrap();
        for s in eval.spans() {
            let w = &eval.inputs()[s.window * 64..(s.window + 1) * 64];
            let line_start = w[..s.start].iter().rposition(|&t| t == b'\n' as u32).map_or(0, |i| i + 1);
            let line: String = w[line_start..s.start].iter().map(|&t| t as u8 as char).collect();
            let (a, b) = line.split_once('+').unwrap();
            let p = Problem { a: a.parse().unwrap(), b: b.parse().unwrap() };
            assert!(p.is_held_out() && !train.contains(&p), "eval problem {p:?} leaked");
        }
        // Roughly the intended share, and a wide spread of problems.
        let all: Vec<Problem> = {
            let mut rng = Rng::new(9, Purpose::Test, &[]);
            (0..100_000).map(|_| Problem::random(&mut rng)).collect()
        };
        let held = all.iter().filter(|p| p.is_held_out()).count();
        assert!((9_000..11_000).contains(&held), "held out {held} of 100000");
        assert!(train.len() > 12_000, "only {} distinct train problems", train.len());
    }

    #[test]
    fn corpus_is_deterministic_in_the_seed_and_at_least_the_requested_size() {
        let a = ArithmeticCorpus::generate(5, 10_000, 5_000);
        assert_eq!(a, ArithmeticCorpus::generate(5, 10_000, 5_000));
        assert_ne!(a.train, ArithmeticCorpus::generate(6, 10_000, 5_000).train);
        assert!((10_000..10_000 + MAX_LINE_LEN).contains(&a.train.len()));
        assert!(a.val.len() >= 4096);
        assert!(a.train.iter().chain(&a.val).all(|&t| (t as usize) < VOCAB_SIZE));
        let longer = ArithmeticCorpus::generate(5, 20_000, 5_000);
        assert_eq!(&longer.train[..a.train.len()], &a.train[..]);
    }

    /// Any window of the training text, read alone, is that stretch of its lines.
    #[test]
    fn train_text_windows_are_generated_by_position_alone() {
        let text = TrainText::new(5);
        let lines = ArithmeticCorpus::generate(5, 2_000, 0).train;
        for (start, len) in [(0, 66), (7, 65), (1_300, 17), (1_001, 1)] {
            let mut out = vec![0; len];
            text.window(start, &mut out);
            assert_eq!(out, lines[start..start + len], "window at {start}");
        }
        let last = text.len() - 13;
        let mut out = vec![0; 13];
        text.window(last, &mut out);
        let line: String = out.iter().map(|&t| t as u8 as char).collect();
        assert!(Problem::parse(line.trim_end()).is_some_and(|p| !p.is_held_out()), "{line:?}");
    }

    /// Runs of different lengths must evaluate on the same held-out windows.
    #[test]
    fn held_out_text_does_not_depend_on_the_training_length() {
        let short = ArithmeticCorpus::generate(5, 10_000, 9_000);
        let long = ArithmeticCorpus::generate(5, 1_000_000, 9_000);
        assert_eq!(short.val, long.val);
        assert!(short.val.len() >= 9_000);
    }

    #[test]
    fn eval_windows_hold_whole_lines_padded_with_newlines() {
        let e = EvalSet::new(3, 20, 5).unwrap();
        assert_eq!(e.n_windows(), 5);
        assert_eq!(e.inputs().len(), 100);
        for w in 0..5 {
            let mut win: Vec<u32> = e.inputs()[w * 20..(w + 1) * 20].to_vec();
            win.push(e.targets()[w * 20 + 19]);
            let text: String = win.iter().map(|&t| t as u8 as char).collect();
            for line in text.split('\n').filter(|l| !l.is_empty()) {
                assert!(Problem::parse(line).is_some(), "window {w}: broken line {line:?} in {text:?}");
            }
        }
        assert!(EvalSet::new(3, 11, 1).is_err());
        assert!(EvalSet::new(3, 12, 1).is_ok());
    }

    #[test]
    fn exact_match_counts_a_problem_only_when_every_answer_token_is_right() {
        // T = 26, one window of 27 bytes: two 13-byte lines and one pad newline.
        let e = EvalSet::pack(26, 1, [Problem { a: 12, b: 5 }, Problem { a: 3, b: 4 }]).unwrap();
        let text: String = e.inputs().iter().map(|&t| t as u8 as char).collect();
        assert_eq!(text, "012+005=7100\n003+004=7000\n");
        assert_eq!(
            e.spans(),
            [AnswerSpan { window: 0, start: 7, len: 5 }, AnswerSpan { window: 0, start: 20, len: 5 }]
        );
        // Span targets are the answer digits and the newline.
        let t = |s: &AnswerSpan| -> String {
            e.targets()[s.start..s.start + s.len].iter().map(|&t| t as u8 as char).collect()
        };
        assert_eq!((t(&e.spans()[0]), t(&e.spans()[1])), ("7100\n".into(), "7000\n".into()));

        let perfect = e.targets().to_vec();
        assert_eq!(e.exact_match(&perfect), (2, 2));
        // Errors outside answer spans do not count.
        let mut p = perfect.clone();
        p[0] = b'9' as u32; // predicting after "0"
        p[13] = b'5' as u32; // predicting the first operand of problem 2
        assert_eq!(e.exact_match(&p), (2, 2));
        // Wrong first digit (the prediction at '=') of problem 2.
        let mut p = perfect.clone();
        p[20] = b'8' as u32;
        assert_eq!(e.exact_match(&p), (1, 2));
        // Not ending the answer: another digit instead of '\n' after "7100".
        let mut p = perfect.clone();
        p[11] = b'0' as u32;
        assert_eq!(e.exact_match(&p), (1, 2));
    }

    #[test]
    fn problem_parse_rejects_wrong_answers_and_junk() {
        assert_eq!(Problem::parse("347+085=2340"), Some(Problem { a: 347, b: 85 }));
        assert_eq!(Problem::parse("347+085=2341"), None);
        assert_eq!(Problem::parse("347+85=2340"), None);
        assert_eq!(Problem::parse("+085=580"), None);
        assert_eq!(Problem::parse("3 4+085=2340"), None);
        assert_eq!(Problem { a: 999, b: 999 }.line(), "999+999=8991\n");
    }
}
