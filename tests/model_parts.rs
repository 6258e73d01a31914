//! The composed model: gradients against finite differences, and the
//! properties the pipeline depends on (recompute and splitting change no bits).

use crossbeam_channel::{Receiver, Sender};
use pipewright::model::block::{BlockActs, Exchange, Recompute};
use pipewright::model::part::{Mode, PartInput};
use pipewright::model::tp::{Followers, Remote, TpCmd, TpFollower, TpShape};
use pipewright::model::{Arch, ModelPart, PartSpec};
use std::collections::BTreeMap;
use std::sync::Mutex;

fn tiny() -> Arch {
    Arch::gpt2(3, 2, 16, 13, 7)
}

fn batch(cfg: &Arch, b: usize, seed: u32) -> (Vec<u32>, Vec<u32>) {
    let n = b * cfg.block_size;
    let v = cfg.vocab_size as u32;
    let tok: Vec<u32> = (0..n as u32).map(|i| (i * 7 + seed * 3 + i * i) % v).collect();
    let tgt: Vec<u32> = (0..n as u32).map(|i| (i * 5 + seed + 1) % v).collect();
    (tok, tgt)
}

/// Mean loss and (after backward) gradients of one whole-model part.
fn loss_and_grads(part: &mut ModelPart, tok: &[u32], tgt: &[u32]) -> f64 {
    let n = tok.len() as f32;
    part.zero_grads();
    let out = part.forward(PartInput::Tokens(tok), Some(tgt), Mode::Train { dloss: 1.0 / n });
    part.backward(out.acts.unwrap(), None);
    part.combine_tied_grads(None);
    out.loss_sum.unwrap() / n as f64
}

fn eval_loss(part: &mut ModelPart, tok: &[u32], tgt: &[u32]) -> f64 {
    let out = part.forward(PartInput::Tokens(tok), Some(tgt), Mode::Eval);
    out.loss_sum.unwrap() / tok.len() as f64
}

#[test]
fn whole_model_gradient_matches_directional_finite_differences() {
    let cfg = tiny();
    let b = 2;
    let mut part = ModelPart::new(cfg, PartSpec::whole(&cfg), b, 5, false);
    // Larger init than GPT-2's so every path carries signal.
    for (i, p) in part.params.iter_mut().enumerate() {
        for (j, x) in p.data.iter_mut().enumerate() {
            *x += 0.3 * (((i * 131 + j * 17) % 23) as f32 / 23.0 - 0.5);
        }
    }
    let (tok, tgt) = batch(&cfg, b, 1);
    loss_and_grads(&mut part, &tok, &tgt);
    let grads: Vec<Vec<f32>> = part.params.iter().map(|p| p.grad.clone()).collect();
    let norm2 = |g: &[f32]| g.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
    let largest = grads.iter().map(|g| norm2(g)).fold(0.0, f64::max);
    for (i, g) in grads.iter().enumerate() {
        // Direction = the gradient itself: the derivative along it is |g|².
        let analytic = norm2(g);
        // A gradient that is rounding alone: k's bias, since softmax ignores
        // a shift of every score of a row alike (GPT-2 has no RoPE to undo that).
        if analytic <= 1e-12 * largest {
            continue;
        }
        let gnorm = analytic.sqrt();
        let h = 1e-2 / gnorm;
        let orig = part.params[i].data.clone();
        let shift = |part: &mut ModelPart, s: f64| {
            for (x, (&o, &d)) in part.params[i].data.iter_mut().zip(orig.iter().zip(g)) {
                *x = (o as f64 + s * d as f64) as f32;
            }
        };
        shift(&mut part, h);
        let up = eval_loss(&mut part, &tok, &tgt);
        shift(&mut part, -h);
        let down = eval_loss(&mut part, &tok, &tgt);
        part.params[i].data.copy_from_slice(&orig);
        let numeric = (up - down) / (2.0 * h);
        let rel = (numeric - analytic).abs() / analytic;
        assert!(rel < 2e-2, "{}: analytic {analytic:e} numeric {numeric:e} rel {rel:e}", part.params[i].name);
    }
}

#[test]
fn recompute_changes_no_bits() {
    let cfg = tiny();
    let (tok, tgt) = batch(&cfg, 3, 2);
    let mut a = ModelPart::new(cfg, PartSpec::whole(&cfg), 3, 9, Recompute::None);
    let want = loss_and_grads(&mut a, &tok, &tgt);
    for how in [Recompute::Selective, Recompute::Full] {
        let mut r = ModelPart::new(cfg, PartSpec::whole(&cfg), 3, 9, how);
        assert_eq!(loss_and_grads(&mut r, &tok, &tgt), want, "{how}");
        for (p, q) in a.params.iter().zip(&r.params) {
            assert_eq!(p.grad, q.grad, "{how}: {}", p.name);
        }
    }
}

#[test]
fn two_parts_give_the_same_bits_as_one() {
    let cfg = tiny();
    let b = 2;
    let mut whole = ModelPart::new(cfg, PartSpec::whole(&cfg), b, 3, false);
    let mut first = ModelPart::new(cfg, PartSpec { layers: 0..1, embedding: true, head: false }, b, 3, false);
    let mut last = ModelPart::new(cfg, PartSpec { layers: 1..3, embedding: false, head: true }, b, 3, false);
    let m = 3;
    let dloss = 1.0 / (m * b * cfg.block_size) as f32;
    whole.zero_grads();
    first.zero_grads();
    last.zero_grads();
    let (mut lw, mut ls) = (0.0, 0.0);
    for mb in 0..m {
        let (tok, tgt) = batch(&cfg, b, mb as u32);
        let o = whole.forward(PartInput::Tokens(&tok), Some(&tgt), Mode::Train { dloss });
        lw += o.loss_sum.unwrap();
        whole.backward(o.acts.unwrap(), None);
        let f = first.forward(PartInput::Tokens(&tok), None, Mode::Train { dloss });
        let l = last.forward(PartInput::Activation(f.output.unwrap()), Some(&tgt), Mode::Train { dloss });
        ls += l.loss_sum.unwrap();
        let dx = last.backward(l.acts.unwrap(), None).unwrap();
        assert!(first.backward(f.acts.unwrap(), Some(dx)).is_none());
    }
    assert_eq!(lw, ls);
    whole.combine_tied_grads(None);
    let head_share = last.wte_head_grad.clone();
    let embed_share = first.params[0].grad.clone();
    first.combine_tied_grads(Some(&head_share));
    last.combine_tied_grads(Some(&embed_share));
    for p in first.params.iter().chain(&last.params) {
        let q = whole.params.iter().find(|q| q.name == p.name).unwrap();
        assert_eq!(p.grad, q.grad, "{}", p.name);
    }
}

#[test]
fn recompute_keeps_less_activation_memory() {
    let cfg = Arch::gpt2(4, 2, 32, 50, 16);
    let (tok, tgt) = batch(&cfg, 4, 0);
    let mut bytes = vec![];
    for recompute in Recompute::ALL {
        let mut p = ModelPart::new(cfg, PartSpec::whole(&cfg), 4, 1, recompute);
        let o = p.forward(PartInput::Tokens(&tok), Some(&tgt), Mode::Train { dloss: 1.0 });
        bytes.push(o.acts.as_ref().unwrap().bytes());
        assert_eq!(p.live_bytes, bytes[bytes.len() - 1], "{recompute}: the part counts what it holds");
        p.backward(o.acts.unwrap(), None);
    }
    // Per block: 16 (N, C)-sized tensors (the input, MLP's 4C twice) plus
    // statistics without recompute; selective drops both norms' outputs and
    // the GELU (6 of them); full keeps the input alone.
    let (n, c, blocks) = (4 * cfg.block_size, cfg.n_embd, cfg.n_layer);
    assert_eq!(bytes[0] - bytes[1], blocks * 4 * n * 6 * c, "{bytes:?}");
    assert_eq!(bytes[1] - bytes[2], blocks * BlockActs::bytes_for(4, &cfg, 1, false, Recompute::Selective));
    assert!(bytes[2] * 5 < bytes[0], "{bytes:?}");
}

fn engine_digest(threads: usize, recompute: Recompute) -> (Vec<f64>, String) {
    use pipewright::config::Config;
    use pipewright::train::engine::Engine;
    let mut cfg = Config::load(
        None,
        &[
            "model.n_layer=2".into(),
            "model.n_embd=64".into(),
            "model.n_head=4".into(),
            "model.block_size=80".into(),
            "train.micro_batch_size=3".into(),
            "parallel.microbatches=2".into(),
        ],
    )
    .unwrap();
    cfg.backend.threads = threads;
    cfg.train.recompute = recompute;
    let mut e = Engine::new(&cfg);
    let mut losses = vec![];
    for step in 0..3u32 {
        let s = e.step(1e-3, |mb, inp, tgt| {
            for (i, (x, y)) in inp.iter_mut().zip(tgt.iter_mut()).enumerate() {
                *x = (i as u32 * 31 + step * 7 + mb as u32 * 3) % 256;
                *y = (i as u32 * 17 + step) % 256;
            }
        });
        losses.push(s.loss);
    }
    (losses, pipewright::model::io::weights_digest(&[&e.part]))
}

#[test]
fn training_steps_are_bit_identical_across_thread_counts_and_recompute() {
    let one = engine_digest(1, Recompute::None);
    assert_eq!(one, engine_digest(2, Recompute::None));
    assert_eq!(one, engine_digest(3, Recompute::Full));
    assert_eq!(one, engine_digest(2, Recompute::Selective));
}

#[test]
fn split_backward_input_then_weight_equals_full_backward() {
    let cfg = tiny();
    let b = 2;
    let spec_a = PartSpec { layers: 0..2, embedding: true, head: false };
    let spec_b = PartSpec { layers: 2..3, embedding: false, head: true };
    let run = |split: bool| {
        let mut first = ModelPart::new(cfg, spec_a.clone(), b, 4, false);
        let mut last = ModelPart::new(cfg, spec_b.clone(), b, 4, false);
        let dloss = 1.0 / (3 * b * cfg.block_size) as f32;
        let mut saved = vec![];
        for mb in 0..3 {
            let (tok, tgt) = batch(&cfg, b, mb as u32);
            let f = first.forward(PartInput::Tokens(&tok), None, Mode::Train { dloss });
            let l = last.forward(PartInput::Activation(f.output.unwrap()), Some(&tgt), Mode::Train { dloss });
            saved.push((f.acts.unwrap(), l.acts.unwrap()));
        }
        // Backwards in microbatch order; with the split, all I's first and the W's after.
        let mut pending = vec![];
        for (mb, (fa, la)) in saved.into_iter().enumerate() {
            if split {
                let dx = last.backward_input(la, None, mb).unwrap();
                assert!(first.backward_input(fa, Some(dx), mb).is_none());
                pending.push(mb);
            } else {
                let dx = last.backward(la, None).unwrap();
                first.backward(fa, Some(dx));
            }
        }
        for mb in pending {
            last.backward_weight(mb);
            first.backward_weight(mb);
        }
        let mut grads: Vec<(String, Vec<f32>)> =
            first.params.iter().chain(&last.params).map(|p| (p.name.clone(), p.grad.clone())).collect();
        grads.push(("head share".into(), last.wte_head_grad.clone()));
        grads
    };
    assert_eq!(run(false), run(true));
}

/// Loss, input gradients and every weight gradient of two microbatches
/// through a first part and a last part split over `tp` ranks; `zb` splits
/// each backward into I and W (W after both I's), `recompute` recomputes blocks.
fn split_run(tp: TpShape, zb: bool, recompute: Recompute) -> (f64, Vec<(String, Vec<u32>)>) {
    split_run_over(tp, None, zb, recompute)
}

/// [`split_run`] with each part's ranks after the first `per` held by
/// followers on threads of their own, reached only through commands and an
/// exchange, as other processes hold them.
fn split_run_over(
    tp: TpShape,
    per: Option<usize>,
    zb: bool,
    recompute: Recompute,
) -> (f64, Vec<(String, Vec<u32>)>) {
    let cfg = Arch::gpt2(3, 4, 32, 13, 8);
    let b = 2;
    let mut followers = Vec::new();
    let mut mk = |spec: PartSpec| {
        let part = ModelPart::new(cfg, spec.clone(), b, 3, recompute);
        match per {
            None => part.with_tp(tp, 2),
            Some(per) => {
                let (remote, threads) = processes(cfg, spec, b, recompute, tp, per);
                followers.extend(threads);
                part.with_tp_over(tp, 2, Some(remote))
            }
        }
    };
    let mut first = mk(PartSpec { layers: 0..1, embedding: true, head: false });
    let mut last = mk(PartSpec { layers: 1..3, embedding: false, head: true });
    let dloss = 1.0 / (2 * b * cfg.block_size) as f32;
    let mut loss = 0.0;
    first.zero_grads();
    last.zero_grads();
    for mb in 0..2 {
        let (tok, tgt) = batch(&cfg, b, mb as u32);
        let f = first.forward(PartInput::Tokens(&tok), None, Mode::Train { dloss });
        let l = last.forward(PartInput::Activation(f.output.unwrap()), Some(&tgt), Mode::Train { dloss });
        loss += l.loss_sum.unwrap();
        if zb {
            let dx = last.backward_input(l.acts.unwrap(), None, mb).unwrap();
            assert!(first.backward_input(f.acts.unwrap(), Some(dx), mb).is_none());
        } else {
            let dx = last.backward(l.acts.unwrap(), None).unwrap();
            assert!(first.backward(f.acts.unwrap(), Some(dx)).is_none());
        }
    }
    if zb {
        for mb in 0..2 {
            last.backward_weight(mb);
            first.backward_weight(mb);
        }
    }
    let grads = first
        .params
        .iter()
        .chain(&last.params)
        .map(|p| (p.name.clone(), p.grad.iter().map(|g| g.to_bits()).collect()))
        .collect();
    // Dropping the parts closes the followers' command channels.
    drop((first, last));
    for f in followers {
        f.join().expect("a follower");
    }
    (loss, grads)
}

type Arrays = Vec<Vec<f32>>;
type Nodes = Vec<(usize, Vec<f32>)>;

/// One process's side of a group's all-reduces: its nodes to every other
/// process, theirs sorted by call number as they come.
struct Bus {
    me: usize,
    to: Vec<Sender<(u64, usize, Arrays)>>,
    from: Mutex<Receiver<(u64, usize, Arrays)>>,
    early: Mutex<BTreeMap<u64, Nodes>>,
    others: usize,
}

impl Exchange for Bus {
    fn swap(&self, seq: u64, first: usize, local: &[&[f32]]) -> Result<Nodes, String> {
        for (p, tx) in self.to.iter().enumerate().filter(|(p, _)| *p != self.me) {
            tx.send((seq, first, local.iter().map(|n| n.to_vec()).collect()))
                .map_err(|e| format!("to {p}: {e}"))?;
        }
        let mut early = self.early.lock().unwrap();
        while early.get(&seq).map_or(0, Vec::len) < self.others {
            let (s, f, nodes) = self.from.lock().unwrap().recv().map_err(|e| e.to_string())?;
            early.entry(s).or_default().extend((f..).zip(nodes));
        }
        Ok(early.remove(&seq).unwrap())
    }
}

/// The owner's channels to its followers.
struct Pipes {
    cmds: Vec<Sender<(TpCmd, Arrays)>>,
    answers: Vec<Receiver<Arrays>>,
}

impl Followers for Pipes {
    fn count(&self) -> usize {
        self.cmds.len()
    }
    fn send(&self, f: usize, cmd: TpCmd, arrays: Arrays) {
        self.cmds[f].send((cmd, arrays)).unwrap();
    }
    fn answer(&self, f: usize) -> Arrays {
        self.answers[f].recv().unwrap()
    }
}

/// A part's tp group as `size / per` processes of `per` ranks: the owner's
/// side, and a thread running each follower's commands.
fn processes(
    cfg: Arch,
    spec: PartSpec,
    b: usize,
    recompute: Recompute,
    tp: TpShape,
    per: usize,
) -> (Remote, Vec<std::thread::JoinHandle<()>>) {
    let procs = tp.size / per;
    let (to, from): (Vec<_>, Vec<_>) = (0..procs).map(|_| crossbeam_channel::unbounded()).unzip();
    let mut buses = from.into_iter().enumerate().map(|(me, rx)| Bus {
        me,
        to: to.clone(),
        from: Mutex::new(rx),
        early: Mutex::new(BTreeMap::new()),
        others: per * (procs - 1),
    });
    let owner_bus = buses.next().unwrap();
    let (mut cmds, mut answers, mut threads) = (Vec::new(), Vec::new(), Vec::new());
    for (i, bus) in buses.enumerate() {
        let (ctx, crx) = crossbeam_channel::unbounded::<(TpCmd, Arrays)>();
        let (atx, arx) = crossbeam_channel::unbounded();
        let local = (i + 1) * per..(i + 2) * per;
        let mut f = TpFollower::new(cfg, spec.clone(), b, recompute, tp, local, 1, Box::new(bus));
        threads.push(std::thread::spawn(move || {
            while let Ok((cmd, arrays)) = crx.recv() {
                if let Some(a) = f.handle(cmd, arrays).unwrap() {
                    atx.send(a).unwrap();
                }
            }
        }));
        cmds.push(ctx);
        answers.push(arx);
    }
    let remote = Remote { per, followers: Box::new(Pipes { cmds, answers }), exchange: Box::new(owner_bus) };
    (remote, threads)
}

#[test]
fn a_part_split_over_two_or_four_ranks_gives_the_bits_of_one_rank_with_the_same_slices() {
    let all = [
        (false, Recompute::None),
        (true, Recompute::None),
        (false, Recompute::Full),
        (false, Recompute::Selective),
        (true, Recompute::Selective),
    ];
    let kept = split_run(TpShape::of(1, 4), false, Recompute::None);
    for (zb, recompute) in all {
        let one = split_run(TpShape::of(1, 4), zb, recompute);
        assert_eq!(one, kept, "one rank (zb {zb}, recompute {recompute}) against keeping everything");
        // Sequence parallelism (sp) shares the rows out between the ranks: the same bits.
        for (size, sp) in [(2, false), (4, false), (2, true), (4, true)] {
            let got = split_run(TpShape { size, slices: 4, sp }, zb, recompute);
            let at = format!("{size} ranks (sp {sp}, zb {zb}, recompute {recompute})");
            assert_eq!(got.0, one.0, "loss at {at}");
            let bad: Vec<&String> =
                got.1.iter().zip(&one.1).filter(|(g, w)| g.1 != w.1).map(|(g, _)| &g.0).collect();
            assert!(bad.is_empty(), "{bad:?} at {at}");
        }
    }
    // The slices are part of the definition: another count is another rounding.
    let plain = split_run(TpShape::WHOLE, false, Recompute::None);
    let four = split_run(TpShape::of(1, 4), false, Recompute::None);
    assert_ne!(plain.1, four.1);
}

#[test]
fn ranks_held_by_followers_in_other_processes_give_the_bits_of_ranks_held_here() {
    let all = [
        (false, Recompute::None),
        (true, Recompute::None),
        (false, Recompute::Full),
        (true, Recompute::Selective),
    ];
    for (zb, recompute) in all {
        let here = split_run(TpShape::of(4, 4), zb, recompute);
        // Sequence parallelism's gathers, reduce-scatters and turns ride the same exchange.
        for (per, sp) in [(1, false), (2, false), (1, true), (2, true)] {
            let over = split_run_over(TpShape { size: 4, slices: 4, sp }, Some(per), zb, recompute);
            let at = format!("{per} ranks per process (sp {sp}, zb {zb}, recompute {recompute})");
            assert_eq!(over.0, here.0, "loss, {at}");
            let bad: Vec<&String> =
                over.1.iter().zip(&here.1).filter(|(g, w)| g.1 != w.1).map(|(g, _)| &g.0).collect();
            assert!(bad.is_empty(), "{bad:?}, {at}");
        }
    }
}

/// An exchange a follower never reaches in these tests: every command here
/// is refused before any rank computes.
struct Unreached;

impl Exchange for Unreached {
    fn swap(&self, _: u64, _: usize, _: &[&[f32]]) -> Result<Vec<(usize, Vec<f32>)>, String> {
        Err("no exchange in this test".into())
    }
}

#[test]
fn a_follower_refuses_commands_that_do_not_fit_its_part_with_a_reason() {
    let cfg = Arch::gpt2(2, 4, 32, 13, 8);
    let spec = PartSpec { layers: 0..2, embedding: false, head: false };
    let tp = TpShape::of(2, 2);
    let mut f = TpFollower::new(cfg, spec, 2, false, tp, 1..2, 1, Box::new(Unreached));
    let n = 2 * 8 * 32;
    let cases: Vec<(TpCmd, Arrays, &str)> = vec![
        (TpCmd::Refresh, vec![vec![0.0; 3]], "shards, not 32"),
        (
            TpCmd::Forward { key: 0, l: 5, keep: true, recompute: false },
            vec![vec![0.0; n]],
            "block 5 of a part with 2",
        ),
        (
            TpCmd::Forward { key: 0, l: 0, keep: true, recompute: false },
            vec![vec![0.0; 7]],
            "of 7 elements, not 512",
        ),
        (TpCmd::Forward { key: 9, l: 1, keep: true, recompute: false }, vec![], "no forward here"),
        (
            TpCmd::BackwardInput { key: 3, l: 1, keep: true, split: false, full: true, nondet: false },
            vec![vec![0.0; n]],
            "no forward here",
        ),
        (TpCmd::BackwardWeight { key: 3, l: 0, nondet: false }, vec![], "before its I"),
    ];
    for (cmd, arrays, want) in cases {
        let what = format!("{cmd:?}");
        let e = f.handle(cmd, arrays).expect_err(&what);
        assert!(e.contains(want), "{what}: {e}");
    }
    // A release of a key it never saw is nothing to refuse.
    assert_eq!(f.handle(TpCmd::Release { key: 77 }, vec![]), Ok(None));
}
