//! The `pipewright` command line: a thin layer over the library. Each command
//! parses its options, calls one library entry point and reports errors with
//! their context, exiting non-zero.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use pipewright::config::Config;
use pipewright::data::{self, Tokenizer};
use pipewright::host::signals::{self, StoppedBeforeStart};
use pipewright::train::run::{train_restarting, AlreadyFinished, Summary, TrainOptions};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "pipewright",
    version,
    about = "Train GPT-style transformers (GPT-2, Llama, Qwen2, …), bit-exact and easy to see into"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Options shared by commands that read a run config.
#[derive(clap::Args, Clone)]
struct ConfigArgs {
    /// TOML config file; without it, the embedded default (configs/default.toml).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Override one config value, e.g. --set optim.lr=3e-4 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
}

impl ConfigArgs {
    fn load(&self, steps: Option<usize>) -> Result<Config> {
        self.load_under(vec![], steps)
    }

    /// [`ConfigArgs::load`] with `first` applied before --set (so --set wins).
    fn load_under(&self, first: Vec<String>, steps: Option<usize>) -> Result<Config> {
        let mut overrides = first;
        overrides.extend(self.set.iter().cloned());
        if let Some(s) = steps {
            overrides.push(format!("train.steps={s}"));
        }
        Ok(Config::load(self.config.as_deref(), &overrides)?)
    }
}

/// Mutual TLS on every link between the processes of a run: all three files
/// or none, on every process.
#[derive(clap::Args, Clone, Debug, Default)]
struct TlsArgs {
    /// This process's certificate (PEM, signed by --tls-ca) [env: PIPEWRIGHT_TLS_CERT].
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM) [env: PIPEWRIGHT_TLS_KEY].
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// The CA that signs every process's certificate (PEM) [env: PIPEWRIGHT_TLS_CA].
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The loaded certificates, or None for a run without TLS.
    fn load(self) -> Result<Option<pipewright::cluster::tls::Tls>> {
        use pipewright::cluster::tls::{Tls, TlsFiles};
        match TlsFiles::resolve(self.tls_cert, self.tls_key, self.tls_ca)? {
            Some(files) => Ok(Some(Tls::load(&files)?)),
            None => Ok(None),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Train a model. With no options, trains the embedded default: a small GPT
    /// learning multi-digit addition from a generated corpus, in a few minutes.
    ///
    /// Writes into --out: metrics.jsonl (one JSON object per step), summary.json,
    /// model.safetensors and config.json (the family's Hugging Face files, which its
    /// transformers class opens), config.toml (the resolved config) and loss.svg.
    Train(TrainArgs),
    /// Train across N processes on this machine (one rank each; see `worker`),
    /// with train's options. Outputs land in one run directory, as with `train`.
    Launch {
        /// Processes to start (the config's pp × dp × tp ranks are split evenly over them).
        #[arg(long)]
        nodes: usize,
        /// Rank 0's cluster port (its data link uses the next one) [default: a free one].
        #[arg(long)]
        port: Option<u16>,
        #[command(flatten)]
        tls: TlsArgs,
        #[command(flatten)]
        train: TrainArgs,
    },
    /// Join a run that spans processes or machines as one rank. Rank 0 takes
    /// train's options and writes the outputs; other ranks get the config from
    /// it. The cookie comes from PIPEWRIGHT_COOKIE_FILE or PIPEWRIGHT_COOKIE.
    /// Under srun, --slurm reads the rank, the run's size and rank 0's node
    /// from SLURM's variables instead.
    Worker {
        /// Rank 0's cluster node, HOST:PORT (or MASTER_ADDR and MASTER_PORT;
        /// with --slurm: the step's first node).
        #[arg(long, value_name = "HOST:PORT")]
        join: Option<String>,
        /// Take this task's place from srun: SLURM_PROCID, SLURM_NTASKS, the
        /// step's node list and tasks per node (rank 0 is on the first node),
        /// SLURM_LOCALID for its share of the node's GPUs. Flags given override them.
        #[arg(long)]
        slurm: bool,
        /// With --slurm: rank 0's cluster port (its data link uses the next one)
        /// [default: 20000 + 2 × (SLURM_JOB_ID mod 5000)].
        #[arg(long, requires = "slurm", conflicts_with = "join")]
        port: Option<u16>,
        /// This process's rank (or RANK).
        #[arg(long)]
        rank: Option<usize>,
        /// Processes in the run (or WORLD_SIZE).
        #[arg(long)]
        world: Option<usize>,
        /// Seconds to wait for every rank to join (at most a day).
        #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=pipewright::cluster::MAX_JOIN_TIMEOUT_S))]
        join_timeout: u64,
        #[command(flatten)]
        tls: TlsArgs,
        #[command(flatten)]
        train: TrainArgs,
    },
    /// Replay a recorded run: one actor alone (--actor), checking every output
    /// digest against the recording, or the whole run again (--all). Exit 0:
    /// identical; 1: diverged (the first divergence is printed); 2: bad input.
    Replay {
        /// The run directory (it holds replay/<actor>.log).
        dir: PathBuf,
        /// The actor to replay: coordinator, loader-R, stage-S, stage-S.R, reducer or checkpointer.
        #[arg(long, conflicts_with = "all", required_unless_present_any = ["all", "list"])]
        actor: Option<String>,
        /// Start at this step's checkpoint instead of the start of the run.
        #[arg(long, value_name = "S", conflicts_with = "all")]
        from_step: Option<u64>,
        /// Read the logs from this directory of the run instead of replay/, e.g.
        /// replay.before-step-N: the part of a run before it resumed from step N.
        #[arg(long, value_name = "DIR")]
        log_dir: Option<PathBuf>,
        /// Accept logs that stop early (a run that crashed or was killed): replay
        /// the entries they hold and say so.
        #[arg(long)]
        allow_truncated: bool,
        /// Re-run the whole system from the recorded config and compare every actor's log.
        #[arg(long)]
        all: bool,
        /// With --all: deliver messages in a random order (consistent with causality).
        #[arg(long, value_name = "SEED", requires = "all")]
        chaos_seed: Option<u64>,
        /// With --all: where the re-run goes [default: a temporary directory].
        #[arg(long, requires = "all")]
        out: Option<PathBuf>,
        /// List the recorded actors and their entry counts.
        #[arg(long)]
        list: bool,
    },
    /// Mean loss of saved weights over the first windows of a token file (or of
    /// a text file, --text). The model comes from --config if given, else from
    /// the weights: the folder's config.json and the config a run stored in
    /// them (both: they must agree), else the embedded default; --set on top.
    Eval {
        #[command(flatten)]
        config: ConfigArgs,
        /// Weights to evaluate (model.safetensors or a run directory).
        #[arg(long)]
        weights: PathBuf,
        /// Evaluate the EMA of the weights the run in --weights (a run folder)
        /// kept (optim.ema_decay): its model.ema.safetensors.
        #[arg(long)]
        ema: bool,
        /// Token file (llm.c .bin or raw uint16).
        #[arg(long, required_unless_present = "text", conflicts_with = "text")]
        data: Option<PathBuf>,
        /// Instead of --data: a text file (any format prepare reads), tokenized
        /// with --tokenizer, else the weights folder's tokenizer.json, else the
        /// built-in tokenizer of model.vocab_size.
        #[arg(long)]
        text: Option<PathBuf>,
        /// With --text: "bytes", "gpt2", or a tokenizer.json or a folder holding one.
        #[arg(long, requires = "text")]
        tokenizer: Option<String>,
        /// Batches of train.micro_batch_size windows (of block_size + 1 tokens,
        /// read sequentially from the start), as train.eval_batches counts
        /// them: a run's own config and val file give its val loss [default:
        /// the config's train.eval_batches].
        #[arg(long, conflicts_with = "windows")]
        batches: Option<usize>,
        /// Windows of block_size + 1 tokens instead of batches.
        #[arg(long)]
        windows: Option<usize>,
        /// Print {"loss": …} instead of a sentence.
        #[arg(long)]
        json: bool,
    },
    /// Continue a prompt with saved weights, printing tokens as they come (CPU).
    ///
    /// The model comes as in eval. The tokenizer is --tokenizer's, else the
    /// weights folder's tokenizer.json, else the vocabulary's (up to 256:
    /// bytes; 50 257 to 50 304: GPT-2's BPE); any other vocabulary is refused. Temperature 0 is greedy; the same --seed gives the same text.
    ///
    /// A model trained on the built-in arithmetic corpus knows only its lines:
    /// operands zero-padded to three digits, the sum written least-significant
    /// digit first ("001+002=" continues "3000"); "1+2=" is text it never saw.
    Generate {
        #[command(flatten)]
        config: ConfigArgs,
        /// Weights (model.safetensors or a run directory).
        #[arg(long)]
        weights: PathBuf,
        /// Text to continue [default: GPT-2's end-of-text token, or a newline for bytes].
        #[arg(long, default_value = "")]
        prompt: String,
        /// Tokens to add after the prompt.
        #[arg(long, default_value_t = 100)]
        max_new_tokens: usize,
        /// Softmax temperature; 0 picks the most likely token every time.
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        /// Sample only among the K most likely tokens [default: all].
        #[arg(long, value_name = "K")]
        top_k: Option<usize>,
        /// Seed of the sampling stream (the same seed gives the same text).
        #[arg(long, default_value_t = 1337)]
        seed: u64,
        /// "bytes", "gpt2", or a tokenizer.json or a folder holding one [default:
        /// the weights folder's tokenizer.json, else from model.vocab_size].
        #[arg(long)]
        tokenizer: Option<String>,
    },
    /// Corpus files into a prepared dataset: llm.c token shards (train.bin and
    /// val.bin, or train_NNNNNN.bin … with --shard-tokens), manifest.json and
    /// the tokenizer's tokenizer.json. Reads text (a file is a document),
    /// JSON lines (.jsonl, .json, .ndjson: a line is a document), parquet (a
    /// row is a document), each of the first two also .gz or .zst; cleans
    /// (--clean), deduplicates (--dedup) and tokenizes on every core, with
    /// the same bytes on any number of threads. Documents are separated by
    /// the tokenizer's end-of-text token (bytes have none). See docs/data.md.
    Prepare(PrepareArgs),
    /// Train or check tokenizers.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Write saved weights (a run, a checkpoint, a Hugging Face folder) as the
    /// family's Hugging Face folder: config.json and model.safetensors, or
    /// shards with their index above --max-shard-size, values stored as
    /// --dtype (bf16 and f16 round to nearest even, once). The model comes
    /// from the weights as eval takes it. --out must be new or empty (or --force).
    Export {
        /// The weights: a run or checkpoint directory, a safetensors file, a (sharded) Hugging Face folder.
        weights: PathBuf,
        /// The folder to write.
        #[arg(long)]
        out: PathBuf,
        /// f32, bf16 or f16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// The largest shard: bytes, or with a unit as transformers writes it (5GB, 500MB, 2GiB).
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
        /// Write into --out even if it holds files (the model's files are replaced).
        #[arg(long)]
        force: bool,
    },
    /// List the tensors (names, dtypes, shapes) and stored config of a weights file or run directory.
    ///
    /// Reads only the file's header, so it is instant on large files. Works on
    /// our weights, a checkpoint's and any family's Hugging Face files alike.
    Inspect {
        /// A .safetensors file, or a run or checkpoint directory (its model.safetensors).
        path: PathBuf,
    },
    /// Every CUDA kernel against its CPU twin on one GPU (f32 and bf16), whole
    /// training steps GPU against CPU, and bit-identical repeats. Needs a build
    /// with --features cuda and a GPU.
    GpuCheck {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Run one group of checks: layernorm, rmsnorm, rope, swiglu, matmul,
        /// attention, elementwise, crossentropy, embedding, adamw, ema, norm,
        /// tree, exactness or steps.
        #[arg(long)]
        only: Option<String>,
    },
    /// Training throughput of a model (--family, GPT-2 124M by default) on one GPU (bf16, random tokens): tokens/s, ms/step and
    /// MFU against 989 TFLOP/s (H100 SXM bf16) and against cuBLASLt's rate measured here.
    GpuBench(GpuBenchArgs),
    /// Training throughput on random tokens: tokens/s, ms/step, GFLOP/s and time per kernel.
    Bench {
        #[command(flatten)]
        config: ConfigArgs,
        /// Timed steps (overrides train.steps).
        #[arg(long)]
        steps: Option<usize>,
        /// Untimed steps first.
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        /// Pipeline sizes to compare through the actor runtime (`--pp` alone: none).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4", num_args = 0..)]
        pp: Vec<usize>,
        /// Microbatches per step in the pipeline comparison.
        #[arg(long, default_value_t = 8)]
        microbatches: usize,
        /// Instead: the simulated backend's table of measured vs theoretical bubble
        /// and runtime overhead for pp ∈ {2,4,8,16,32} × m ∈ {p,2p,4p,8p}.
        #[arg(long)]
        sim: bool,
        /// Instead: the CPU data plane on loopback (frame round-trip latency,
        /// bandwidth of large frames), through the real codec and sockets
        /// (and TLS sessions, given --tls-*).
        #[arg(long, conflicts_with = "sim")]
        transport: bool,
        #[command(flatten)]
        tls: TlsArgs,
        /// Instead: the data pipeline on a corpus it generates (--data-mb of
        /// jsonl.zst and parquet with planted duplicates and junk): MB/s of
        /// read+clean, dedup, tokenize and the whole prepare, peak memory,
        /// near-duplicate recall and unique documents removed.
        #[arg(long, conflicts_with_all = ["sim", "transport"])]
        data: bool,
        /// With --data: megabytes of text to generate.
        #[arg(long, default_value_t = 1024)]
        data_mb: u64,
        /// With --data: where the corpus and outputs go.
        #[arg(long, default_value = "target/data-bench")]
        data_dir: PathBuf,
        /// With --data: worker threads.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// With --data: also time Python's `tokenizers` on the same file and
        /// tokenizer, with this interpreter (scripts/bench_tokenizers.py).
        #[arg(long, value_name = "PYTHON")]
        python: Option<PathBuf>,
        /// With --sim: the schedule to measure.
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// With --sim: where to write the plot.
        #[arg(long, default_value = "bench-sim.svg")]
        plot: PathBuf,
        /// With --sim: only these cells, as PPxM (e.g. `8x32,32x256`); default the whole grid.
        #[arg(long, value_delimiter = ',', value_parser = parse_cell)]
        cells: Vec<(usize, usize)>,
        /// End with one JSON line holding the figures.
        #[arg(long)]
        json: bool,
    },
    /// Build a pipeline schedule, check it, and draw its simulated timeline (unit costs).
    Schedule {
        /// gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev.
        #[arg(long)]
        kind: String,
        /// Pipeline ranks (p).
        #[arg(long)]
        stages: usize,
        /// Microbatches per step (m).
        #[arg(long)]
        microbatches: usize,
        /// Model chunks per rank (v) [default: 2 for interleaved, zb-v and dualpipev, else 1].
        #[arg(long)]
        chunks: Option<usize>,
        /// Print only the per-rank action lists: {"ranks": [["0F0", …], …]}.
        #[arg(long)]
        json: bool,
        /// Also write the simulated timeline as a Chrome trace (the format of train --trace).
        #[arg(long, value_name = "FILE")]
        trace: Option<PathBuf>,
        /// With --trace: action costs in ms, F,B or F,B,I,W [default: 1,2,1,1].
        #[arg(long, value_delimiter = ',', value_name = "MS")]
        costs: Vec<f64>,
    },
    /// Read a trace (from train --trace or schedule --trace): where the time went, or a picture.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Plan a run: FLOPs, Chinchilla sizing, time and cost, memory per GPU, and the
    /// fastest parallel layouts that fit (tp, pp, dp, microbatches, schedule).
    Plan(pipewright::plan::PlanArgs),
}

#[derive(clap::Args)]
struct PrepareArgs {
    /// Files, or folders whose files are read in name order (subfolders too).
    #[arg(required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// "bytes" (vocab 256), "gpt2" (GPT-2's BPE, vocab 50257; no download), or a
    /// Hugging Face tokenizer.json or a folder holding one (a model's own).
    #[arg(long, default_value = "bytes")]
    tokenizer: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// A prepare config (TOML): text_field, skip_bad_lines, val_fraction,
    /// shard_tokens, and [clean] / [dedup] tables (see docs/data.md). Flags win.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Apply the quality filters (Gopher quality and repetition, C4 lines).
    #[arg(long)]
    clean: bool,
    /// Remove exact and near-duplicate documents (MinHash LSH).
    #[arg(long)]
    dedup: bool,
    /// The JSON field or parquet column holding the text [default: text].
    #[arg(long)]
    text_field: Option<String>,
    /// Skip and count JSON lines that do not parse or lack the field, instead of stopping.
    #[arg(long)]
    skip_bad_lines: bool,
    /// Tokens per shard [default: one train.bin and one val.bin].
    #[arg(long)]
    shard_tokens: Option<u64>,
    /// Fraction of tokens, from the end, kept for validation [default: 0.1].
    #[arg(long)]
    val_fraction: Option<f64>,
    /// Worker threads [default: one per core]; the output is the same for any number.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Also draw the report (removals per filter, document lengths before and after) as SVG.
    #[arg(long, value_name = "FILE.svg")]
    report: Option<PathBuf>,
    /// Replace an earlier dataset in --out.
    #[arg(long)]
    force: bool,
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer on corpus files (the readers of
    /// prepare) and save it as a Hugging Face tokenizer.json, which
    /// transformers loads as it is. The same corpus and settings give the
    /// same file, byte for byte.
    Train(TokenizerTrainArgs),
}

/// `tokenizer train`'s options.
#[derive(clap::Args)]
struct TokenizerTrainArgs {
    /// Files or folders, as prepare reads them.
    #[arg(required = true, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Tokens in the vocabulary, the 256 bytes and special tokens included.
    #[arg(long)]
    vocab_size: usize,
    /// Where to write tokenizer.json (a folder: DIR/tokenizer.json).
    #[arg(long)]
    out: PathBuf,
    /// Pre-tokenizer regex: "gpt2" or "llama3".
    #[arg(long, default_value = "gpt2")]
    pattern: String,
    /// Special tokens, ids 0, 1, … in order (repeatable).
    #[arg(long = "special", default_value = "<|endoftext|>")]
    special: Vec<String>,
    /// Merge only pairs seen at least this often.
    #[arg(long, default_value_t = 2)]
    min_frequency: u64,
    /// The JSON field or parquet column holding the text.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// Skip JSON lines that do not parse or lack the field.
    #[arg(long)]
    skip_bad_lines: bool,
    /// Worker threads [default: one per core]; the file is the same for any number.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Replace an existing --out.
    #[arg(long)]
    force: bool,
}

/// Train's options (also taken by `launch` and `worker`).
#[derive(clap::Args, Clone)]
struct TrainArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Optimizer steps (overrides train.steps).
    #[arg(long)]
    steps: Option<usize>,
    /// Run directory [default: runs/<date>-<time>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Start from these weights instead of a fresh init: a safetensors file, or a
    /// folder holding model.safetensors or shards with their index (a run, or a
    /// Hugging Face save_pretrained folder of any family, f32, bf16 or f16; its
    /// config.json, or the config a run stored in the weights, gives the model).
    #[arg(long, value_name = "W.safetensors|DIR")]
    init: Option<PathBuf>,
    /// Replace the outputs of an earlier run in --out.
    #[arg(long)]
    force: bool,
    /// Continue the run in DIR from its latest complete checkpoint, with
    /// DIR/config.toml unless --config says otherwise (--set and flags on top;
    /// what differs from the checkpoint's config is listed by key).
    #[arg(long, value_name = "DIR", conflicts_with = "out")]
    resume: Option<PathBuf>,
    /// When the run fails after starting (a stage errors or panics), resume it
    /// from its latest checkpoint, up to N times.
    #[arg(long, value_name = "N", default_value_t = 0)]
    max_restarts: usize,
    /// Write trace.json (Chrome Trace Event format; open it in Perfetto).
    #[arg(long)]
    trace: bool,
    /// Deliver messages between actors after random delays, in a scrambled
    /// order (results must not change: a check of determinism).
    #[arg(long, value_name = "SEED")]
    chaos_seed: Option<u64>,
    /// Record every actor's handled messages into DIR/replay/<actor>.log
    /// (digests of every tensor; see `pipewright replay`).
    #[arg(long)]
    record: bool,
    /// Keep the tensors' bytes too for these actors (comma-separated names,
    /// or "all"), so they can be replayed alone. Implies --record.
    #[arg(long, value_name = "ACTORS", value_delimiter = ',')]
    record_payloads: Vec<String>,
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Busy time, warmup/cooldown bubbles and waits per stage, measured vs theory bubble,
    /// the critical path of a step and the top causes of idle time.
    Summary {
        /// trace.json from train --trace or schedule --trace.
        file: PathBuf,
        /// Print the figures as JSON.
        #[arg(long)]
        json: bool,
        /// Summarize one data-parallel replica alone (a dp > 1 run's trace
        /// holds all of them; the default averages over every replica).
        #[arg(long, value_name = "R")]
        replica: Option<usize>,
    },
    /// Draw one step's lanes, measured above theory, as HTML (inline SVG) or SVG (by -o's extension).
    Render {
        /// trace.json from train --trace or schedule --trace.
        file: PathBuf,
        /// Where to write the picture (.html or .svg).
        #[arg(short, long, value_name = "timeline.html")]
        out: PathBuf,
        /// The step to draw [default: the step of median duration].
        #[arg(long)]
        step: Option<u64>,
    },
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        // `generate | head`: the reader has what it wanted.
        use pipewright::generate::GenerateError;
        if matches!(e.downcast_ref::<GenerateError>(), Some(GenerateError::OutputClosed)) {
            return;
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The library's events print on stderr as the plain lines users have always
/// seen (no time, level or target); RUST_LOG chooses which (by default
/// pipewright's, info and up). The trace's record layer sits beside it with
/// a filter of its own, so RUST_LOG never changes what a trace holds.
fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let records_off = format!("{}=off", pipewright::trace::layer::TARGET);
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("pipewright=info"))
        .add_directive(records_off.parse().expect("a target directive"));
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .event_format(PlainLines)
        .with_filter(filter);
    let subscriber = tracing_subscriber::registry().with(lines).with(pipewright::trace::layer::layer());
    // Nothing else in the process sets one first.
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// An event as its message alone (and any other fields after it).
struct PlainLines;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for PlainLines
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// `prepare`: the options from the config file and flags (flags win), the
/// pipeline, then its report as a table (and an SVG when asked).
fn prepare_command(a: PrepareArgs) -> Result<()> {
    let tok = Tokenizer::from_arg(&a.tokenizer).map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?;
    let mut o = data::PrepareOptions::default();
    if let Some(c) = &a.config {
        o = data::PrepareConfig::load(c)?.apply(o);
    }
    if a.clean && o.clean.is_none() {
        o.clean = Some(Default::default());
    }
    if a.dedup && o.dedup.is_none() {
        o.dedup = Some(Default::default());
    }
    if let Some(f) = a.text_field {
        o.read.text_field = f;
    }
    o.read.skip_bad_lines |= a.skip_bad_lines;
    if let Some(n) = a.shard_tokens {
        o.shard_tokens = n;
    }
    if let Some(v) = a.val_fraction {
        o.val_fraction = v;
    }
    o.threads = a.threads;
    o.force = a.force;
    o.progress = std::io::stderr().is_terminal();
    let r = data::prepare::run(&a.input, &tok, &a.out, &o)?;
    print!("{}", data::report::table(&r));
    if let Some(svg) = &a.report {
        data::report::write_svg(&r.manifest, svg)?;
        println!("report: {}", svg.display());
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn gpu_check(device: usize, only: Option<String>) -> anyhow::Result<()> {
    use pipewright::kernels::cuda::Gpu;
    use pipewright::model::gpu::check;
    let only =
        only.map(|o| o.parse::<check::Group>()).transpose().map_err(|e| anyhow::anyhow!("--only: {e}"))?;
    let gpu = Gpu::new(device)?;
    println!("pipewright gpu-check: GPU {device}, {} (sm_{})", gpu.name, gpu.arch);
    // Each line as soon as its check finishes, so a crash shows what ran before it.
    let checks = check::run(&gpu, only, &mut |p| match p {
        check::Progress::Started(g, tag) => println!("-- group {} {tag}", g.name()),
        check::Progress::Finished(g, c) => println!("{}", check::line(g, c)),
    })?;
    let failed = checks.iter().filter(|c| !c.passed()).count();
    anyhow::ensure!(failed == 0, "{failed} of {} GPU checks failed", checks.len());
    println!("all {} GPU checks passed", checks.len());
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn gpu_check(_device: usize, _only: Option<String>) -> anyhow::Result<()> {
    Err(pipewright::kernels::BackendError::NotBuilt.into())
}

#[cfg(feature = "cuda")]
fn gpu_bench(args: GpuBenchArgs) -> anyhow::Result<()> {
    use pipewright::kernels::cuda::Gpu;
    use pipewright::model::gpu::bench;
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    anyhow::ensure!(args.micro_batch != Some(0), "--micro-batch must be at least 1");
    anyhow::ensure!(args.matmul_size > 0, "--matmul-size must be at least 1");
    let cfg = bench_arch(&args)?;
    // The flags are checked before the GPU opens, so a mistake is named on any machine.
    let gpu = Gpu::new(args.device)?;
    eprintln!("pipewright gpu-bench: GPU {}, {} (sm_{})", args.device, gpu.name, gpu.arch);
    if args.counts {
        let report = bench::counts(&gpu, cfg, args.micro_batch.unwrap_or(1))?;
        print!("{}", bench::counts_table(&report));
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        }
        return Ok(());
    }
    let bargs = bench::BenchArgs {
        cfg,
        micro_batch: args.micro_batch,
        steps: args.steps,
        warmup: args.warmup,
        matmul_size: args.matmul_size,
        recompute: args.recompute,
    };
    let report = bench::run(&gpu, &bargs, |line| eprintln!("{line}"))?;
    print!("{}", bench::table(&report));
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn gpu_bench(_args: GpuBenchArgs) -> anyhow::Result<()> {
    Err(pipewright::kernels::BackendError::NotBuilt.into())
}

/// The flags of `gpu-bench`.
#[derive(clap::Args)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct GpuBenchArgs {
    /// The family (model.family): "gpt2", "llama", …
    #[arg(long, default_value = "gpt2", value_parser = parse_family)]
    family: String,
    /// Key/value heads, dividing --heads [default: --heads] (model.n_kv_head).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// The MLP's width (model.intermediate_size) [default: the family's, where it has one].
    #[arg(long)]
    ffn: Option<usize>,
    /// The rotary embedding's base, for rotary families (model.rope_theta).
    #[arg(long, default_value_t = 10_000.0)]
    rope_theta: f64,
    /// The head reads the token embedding (model.tie_word_embeddings).
    #[arg(long)]
    tied: bool,
    /// Transformer blocks (n_layer).
    #[arg(long, default_value_t = 12)]
    layers: usize,
    /// Embedding width (n_embd).
    #[arg(long, default_value_t = 768)]
    embd: usize,
    /// Attention heads (n_head).
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 50257)]
    vocab: usize,
    /// Sequence length T.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// Sequences per step [default: the largest of 64, 32, 16, … that fits].
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Untimed steps first (the first compiles the kernels and plans the products).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Side of the square bf16 product that measures cuBLASLt's rate.
    #[arg(long, default_value_t = 8192)]
    matmul_size: usize,
    /// What backward computes again (train.recompute): none, selective or full.
    #[arg(long, default_value = "none", value_parser = parse_recompute)]
    recompute: pipewright::model::recompute::Recompute,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// End with one JSON line holding the figures.
    #[arg(long)]
    json: bool,
    /// Instead of timing: count what a steady step asks of the driver (launches,
    /// cuBLASLt calls, host-blocking synchronizes, copies and their bytes,
    /// allocations), per step, per microbatch and per block [micro-batch default 1].
    #[arg(long)]
    counts: bool,
}

fn parse_recompute(s: &str) -> Result<pipewright::model::recompute::Recompute, String> {
    use pipewright::model::recompute::Recompute;
    Recompute::ALL
        .into_iter()
        .find(|r| r.name() == s)
        .ok_or_else(|| format!("\"{s}\": expected none, selective or full"))
}

fn parse_family(s: &str) -> Result<String, String> {
    use pipewright::model::Family;
    match Family::named(s) {
        Some(_) => Ok(s.to_string()),
        None => Err(format!("\"{s}\": expected one of {}", Family::names())),
    }
}

/// gpu-bench's model: its flags as a `[model]` section, under the rules
/// `train` applies, each problem named by its flag.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn bench_arch(args: &GpuBenchArgs) -> anyhow::Result<pipewright::model::Arch> {
    let m = pipewright::model::ModelSection {
        family: args.family.clone(),
        n_layer: args.layers,
        n_head: args.heads,
        n_embd: args.embd,
        vocab_size: args.vocab,
        block_size: args.seq,
        n_kv_head: args.kv_heads.unwrap_or(0),
        intermediate_size: args.ffn.unwrap_or(0),
        rope_theta: args.rope_theta,
        tie_word_embeddings: args.tied.then_some(true),
        ..Default::default()
    };
    m.arch().map_err(|problems| {
        let flag = |path: &str| match path {
            "model.n_layer" => "--layers",
            "model.n_head" => "--heads",
            "model.n_embd" => "--embd",
            "model.vocab_size" => "--vocab",
            "model.block_size" => "--seq",
            "model.n_kv_head" => "--kv-heads",
            "model.intermediate_size" => "--ffn",
            "model.rope_theta" => "--rope-theta",
            "model.tie_word_embeddings" => "--tied",
            _ => "--family",
        };
        let lines: Vec<String> = problems
            .iter()
            .map(|p| {
                format!(
                    "{} {} (--family {}: {}): {}",
                    flag(&p.path),
                    p.value,
                    args.family,
                    p.path,
                    p.expected
                )
            })
            .collect();
        anyhow::anyhow!("{}", lines.join("\n"))
    })
}

fn default_run_dir() -> PathBuf {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    PathBuf::from(format!("runs/{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60))
}

fn train_command(args: TrainArgs, cluster: Option<&mut pipewright::cluster::Driver>) -> Result<()> {
    let TrainArgs {
        mut config,
        steps,
        out,
        init,
        force,
        resume,
        max_restarts,
        trace,
        chaos_seed,
        record,
        record_payloads,
    } = args;
    let resuming = resume.is_some();
    let out_dir = resume.or(out).unwrap_or_else(default_run_dir);
    let own_config = match (resuming, &config.config) {
        (true, None) => pipewright::train::resume::own_config(&out_dir)?,
        _ => None,
    };
    let is_own = own_config.is_some();
    if is_own {
        config.config = own_config;
    }
    signals::install(&out_dir)?;
    let mut cfg = load_train_config(&config, init.as_deref(), steps, is_own)?;
    cfg.trace.enabled |= trace;
    cfg.replay.record |= record || !record_payloads.is_empty();
    for a in record_payloads {
        if !cfg.replay.payloads.contains(&a) {
            cfg.replay.payloads.push(a);
        }
    }
    check_train_config(&cfg)?;
    eprintln!("pipewright train → {}", out_dir.display());
    let opts = TrainOptions { out_dir: out_dir.clone(), init, force, progress: true, resume: resuming };
    let (s, _) = match train_restarting(&cfg, opts, chaos_seed, cluster, max_restarts) {
        Ok(r) => r,
        Err(e)
            if e.downcast_ref::<StoppedBeforeStart>().is_some()
                || e.downcast_ref::<AlreadyFinished>().is_some() =>
        {
            eprintln!("{e}");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    print_done(&cfg, &s)?;
    eprintln!("outputs in {}", out_dir.display());
    Ok(())
}

/// The run's config from `config` (the run's own when `own_config`), with
/// the model's shape from an --init folder's config.json under --set, and
/// the layer split a resume's own config recorded dropped when it no longer
/// fits.
fn load_train_config(
    config: &ConfigArgs,
    init: Option<&std::path::Path>,
    steps: Option<usize>,
    own_config: bool,
) -> Result<Config> {
    // An --init's model (its config.json, or the config stored in its
    // weights; both, they must agree) gives the model (under --set).
    let model = match init {
        Some(path) => {
            let file = pipewright::model::io::weights_file(path);
            let meta = pipewright::model::io::read_metadata(path)?;
            let stored = meta.get(pipewright::model::io::CONFIG_METADATA_KEY).map(String::as_str);
            pipewright::model::hf::weights_model(&file, stored)?
        }
        None => None,
    };
    if let Some(m) = &model {
        let s = &m.section;
        eprintln!(
            "model from {}: {} layers, {} heads, {} wide, vocab {}, {} positions",
            m.origin, s.n_layer, s.n_head, s.n_embd, s.vocab_size, s.block_size
        );
    }
    let mut cfg = config.load_under(model.map(|m| m.section.overrides()).unwrap_or_default(), steps)?;
    let split_given = config.set.iter().any(|s| s.trim_start().starts_with("parallel.layers_per_stage"));
    if own_config && !split_given {
        if let Some(note) = pipewright::train::resume::refit_stored_split(&mut cfg) {
            eprintln!("{note}");
        }
    }
    Ok(cfg)
}

/// Validates the run's config, printing its warnings, and says how an
/// uneven default layer split falls.
fn check_train_config(cfg: &Config) -> Result<()> {
    cfg.validate()?;
    for w in cfg.warnings() {
        eprintln!("warning: {w}");
    }
    if cfg.parallel.layers_per_stage.is_empty() {
        // An uneven split is a choice the user did not make: say which.
        let layout = pipewright::actors::Layout::from_config(cfg)?;
        let split: Vec<usize> = layout.stages.iter().map(|s| s.layers.len()).collect();
        if split.iter().any(|&n| n != split[0]) {
            eprintln!(
                "model.n_layer = {} over {} stages splits as parallel.layers_per_stage = {split:?} \
                 (earlier stages take the extra layers; set parallel.layers_per_stage to choose)",
                cfg.model.n_layer,
                split.len()
            );
        }
    }
    Ok(())
}

/// The line that ends a run: its loss and speed, or for the simulated
/// backend its step time against the schedule's makespan.
fn print_done(cfg: &Config, s: &Summary) -> Result<()> {
    if cfg.backend.kind == pipewright::config::BackendKind::Sim {
        // Nothing is computed: what the sim measures is the runtime against the schedule.
        let ideal = pipewright::plan::cpu::sim_step_ms(cfg)?;
        let step_ms = s.train_seconds * 1e3 / s.steps.max(1) as f64;
        eprintln!(
            "done: {} steps of the simulated backend (no compute, no loss): {step_ms:.1} ms per step \
             (coordinator round trip), the schedule's makespan at the [sim] costs is {ideal:.1} ms \
             ({:+.1}%); per-action bubbles and overhead: pipewright trace summary on a --trace run",
            s.steps,
            100.0 * (step_ms / ideal - 1.0)
        );
    } else {
        eprintln!(
            "done: {} steps, loss {:.4}{}{}, {:.0} tokens/s, {:.1} GFLOP/s{}",
            s.steps,
            s.final_loss,
            s.val_loss.map(|v| format!(", val loss {v:.4}")).unwrap_or_default(),
            s.exact_match.map(|e| format!(", held-out exact match {:.1}%", 100.0 * e)).unwrap_or_default(),
            s.tokens_per_s,
            s.model_gflops,
            match (s.gemm_util, s.mfu) {
                (Some(u), _) => format!(" (gemm_util {:.0}%: of the gemm rate measured here)", 100.0 * u),
                (_, Some(m)) => format!(" (MFU {:.1}% of the datasheet peak)", 100.0 * m),
                _ => String::new(),
            }
        );
        eprintln!("weights digest {}", s.weights_digest);
        if let Some(d) = &s.ema_weights_digest {
            let val = s.ema_val_loss.map(|v| format!(", val loss {v:.4}")).unwrap_or_default();
            eprintln!("EMA of the weights (model.ema.safetensors){val}, digest {d}");
        }
    }
    Ok(())
}

/// `launch`'s own arguments left out: what each `worker` gets.
fn launch_args() -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut it = std::env::args_os().skip_while(|a| a != "launch").skip(1);
    while let Some(a) = it.next() {
        let text = a.to_string_lossy();
        if text == "--nodes" || text == "--port" {
            it.next();
        } else if !(text.starts_with("--nodes=") || text.starts_with("--port=")) {
            out.push(a);
        }
    }
    out
}

/// Ok(true): identical; Ok(false): diverged (already printed).
fn replay_command(
    dir: &std::path::Path,
    actor: Option<String>,
    opts: pipewright::train::replay::ReplayOptions,
    all: bool,
    chaos_seed: Option<u64>,
    out: Option<PathBuf>,
    list: bool,
) -> Result<bool> {
    use pipewright::train::replay::{actors_in, prepare_all, replay_actor, Verdict};
    if list {
        let logs = opts.logs_dir(dir);
        for a in actors_in(dir, &logs)? {
            let path = logs.join(format!("{a}.log"));
            let r = pipewright::replay::LogReader::read(&path, true)?;
            let payloads = if r.header.payloads { "with payloads" } else { "digests only" };
            let cut = if r.cut.is_some() { "  cut off (no end marker)" } else { "" };
            println!("{a:<14} {:>7} entries  {payloads}{cut}", r.entries.len());
        }
        return Ok(true);
    }
    if all {
        // Everything that can be refused is, before anything runs.
        let run = prepare_all(dir, &opts)?;
        let tmp;
        let keep_out = out.is_some();
        let out = match out {
            Some(o) => o,
            None => {
                tmp = pipewright::train::replay::scratch_dir("all")?;
                tmp.clone()
            }
        };
        eprintln!("re-running the recorded config from {} into {}", run.starts_from(), out.display());
        let result = run.run(&out, chaos_seed);
        if !keep_out {
            let _ = std::fs::remove_dir_all(&out);
        }
        let verdicts = result?;
        let mut same = true;
        for v in &verdicts {
            same &= matches!(v, Verdict::Identical { .. });
            println!("{v}");
        }
        println!(
            "{}",
            if same {
                "the whole run replayed identically"
            } else {
                "the run diverged (first divergence per actor above)"
            }
        );
        return Ok(same);
    }
    let actor = actor.expect("clap requires --actor without --all");
    let v = replay_actor(dir, &actor, &opts)?;
    println!("{v}");
    Ok(matches!(v, Verdict::Identical { .. }))
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => train_command(args, None),
        Command::Launch { nodes, port, tls, train } => launch_command(nodes, port, tls, train),
        Command::Worker { join, slurm, port, rank, world, join_timeout, tls, train } => {
            let place = WorkerPlace { join, slurm, port, rank, world };
            worker_command(place, join_timeout, tls, train)
        }
        Command::Replay { dir, actor, from_step, log_dir, allow_truncated, all, chaos_seed, out, list } => {
            let opts = pipewright::train::replay::ReplayOptions { from_step, log_dir, allow_truncated };
            match replay_command(&dir, actor, opts, all, chaos_seed, out, list) {
                Ok(true) => Ok(()),
                Ok(false) => std::process::exit(1),
                Err(e) => {
                    eprintln!("error: {e:#}");
                    std::process::exit(2);
                }
            }
        }
        Command::Eval { config, weights, ema, data, text, tokenizer, batches, windows, json } => {
            use pipewright::train::eval::Amount;
            let weights = if ema { pipewright::train::eval::ema_weights(&weights)? } else { weights };
            let amount = match (batches, windows) {
                (_, Some(w)) => Amount::Windows(w),
                (Some(b), None) => Amount::Batches(b),
                (None, None) => Amount::ConfigBatches,
            };
            eval_command(config, weights, EvalInput { data, text, tokenizer }, amount, json)
        }
        Command::Generate {
            config,
            weights,
            prompt,
            max_new_tokens,
            temperature,
            top_k,
            seed,
            tokenizer,
        } => {
            let sampling = pipewright::generate::Sampling { temperature, top_k, seed };
            generate_command(config, weights, prompt, max_new_tokens, sampling, tokenizer)
        }
        Command::Prepare(args) => prepare_command(args),
        Command::Tokenizer(TokenizerCommand::Train(args)) => tokenizer_train(args),
        Command::Inspect { path } => print_out(&pipewright::inspect::inspect(&path)?),
        Command::Export { weights, out, dtype, max_shard_size, force } => {
            let files = pipewright::train::export::export(&weights, &out, &dtype, &max_shard_size, force)?;
            for f in files {
                println!("{}", f.display());
            }
            Ok(())
        }
        Command::GpuCheck { device, only } => gpu_check(device, only),
        Command::GpuBench(args) => gpu_bench(args),
        Command::Bench { data: true, data_mb, data_dir, threads, python, json, .. } => {
            bench_data(&data_dir, data_mb, threads, python, json)
        }
        Command::Bench { transport: true, tls, json, .. } => bench_transport(tls, json),
        Command::Bench { sim: true, schedule, plot, json, cells, .. } => {
            bench_sim(schedule, plot, json, cells)
        }
        Command::Bench { config, steps, warmup, pp, microbatches, json, .. } => {
            bench_command(config, steps, warmup, pp, microbatches, json)
        }
        Command::Schedule { kind, stages, microbatches, chunks, json, trace, costs } => {
            schedule_command(kind, stages, microbatches, chunks, json, trace, costs)
        }
        Command::Trace(TraceCommand::Summary { file, json, replica }) => trace_summary(file, json, replica),
        Command::Trace(TraceCommand::Render { file, out, step }) => {
            let step = pipewright::trace::render::write(&file, &out, step)?;
            eprintln!("step {step} → {}", out.display());
            Ok(())
        }
        Command::Plan(args) => {
            print!("{}", pipewright::plan::cli(&args)?);
            Ok(())
        }
    }
}

/// `launch`: starts `nodes` worker processes on this machine, with train's flags.
fn launch_command(nodes: usize, port: Option<u16>, tls: TlsArgs, train: TrainArgs) -> Result<()> {
    // Checked here so a bad file is one error, not one per process;
    // the workers get the same flags (or inherit the variables).
    tls.load()?;
    // A layout the processes cannot hold is refused before any starts.
    train.config.load(train.steps)?.check_processes(nodes)?;
    let args = launch_args();
    pipewright::cluster::launch(nodes, port, &args, std::time::Duration::from_secs(30))?;
    Ok(())
}

/// `worker`'s flags that say where the process stands in the run.
struct WorkerPlace {
    join: Option<String>,
    slurm: bool,
    port: Option<u16>,
    rank: Option<usize>,
    world: Option<usize>,
}

/// `worker`: joins a run as one rank; rank 0 trains and writes the outputs.
fn worker_command(place: WorkerPlace, join_timeout: u64, tls: TlsArgs, train: TrainArgs) -> Result<()> {
    let timeout = std::time::Duration::from_secs(join_timeout);
    let WorkerPlace { join, slurm, port, rank, world } = place;
    let spec = if slurm {
        slurm_join(join.as_deref(), rank, world, port, timeout)?
    } else {
        pipewright::cluster::JoinSpec::resolve(join.as_deref(), rank, world, timeout)?
    }
    .with_tls(tls.load()?);
    if spec.rank > 0 {
        pipewright::cluster::run_worker(&spec)?;
        match pipewright::train::run::peak_rss_bytes() {
            Some(b) => {
                eprintln!("rank {}: done (peak RSS {:.1} MiB)", spec.rank, b as f64 / (1 << 20) as f64)
            }
            None => eprintln!("rank {}: done", spec.rank),
        }
        return Ok(());
    }
    if train.max_restarts > 0 {
        anyhow::bail!("--max-restarts: not supported for runs that span processes");
    }
    let cfg = train.config.load(train.steps)?;
    pipewright::limits::check(&cfg)?;
    let layout = pipewright::actors::Layout::from_config(&cfg)?;
    let placement = pipewright::cluster::Placement::new(layout.pp, layout.dp, cfg.parallel.tp, spec.world)?;
    let mut driver = pipewright::cluster::Driver::rendezvous(&spec, placement)?;
    let result = train_command(train, Some(&mut driver));
    driver.finish(result.as_ref().err().map(|e| format!("{e:#}")));
    result
}

/// `worker --slurm`: the place srun gave this task, and its share of the
/// node's GPUs. Runs before any thread starts: it may narrow
/// CUDA_VISIBLE_DEVICES, which CUDA reads once, when it starts.
fn slurm_join(
    join: Option<&str>,
    rank: Option<usize>,
    world: Option<usize>,
    port: Option<u16>,
    timeout: std::time::Duration,
) -> Result<pipewright::cluster::JoinSpec> {
    use pipewright::cluster::slurm::{gpu_view, GpuView, SlurmTask};
    let var = |v: &str| std::env::var(v).ok();
    let task = SlurmTask::read(&var)?;
    let spec = pipewright::cluster::JoinSpec::from_slurm(join, rank, world, port, timeout, &task)?;
    let visible = var("CUDA_VISIBLE_DEVICES");
    // srun binds each task's GPUs for --gpus-per-task (SLURM_GPUS_PER_TASK)
    // or a --gpu-bind other than none (SLURM_GPU_BIND).
    let bound = var("SLURM_GPUS_PER_TASK").is_some()
        || var("SLURM_GPU_BIND").is_some_and(|b| !b.split(',').any(|part| part.trim() == "none"));
    let gpus = match gpu_view(visible.as_deref(), bound, task.tasks_here(), task.local_id) {
        GpuView::Keep(why) => why,
        GpuView::Narrow(share) => {
            // Single-threaded here (see above), so no reader races the write.
            std::env::set_var("CUDA_VISIBLE_DEVICES", &share);
            format!("CUDA_VISIBLE_DEVICES={share}: this task's share of {}", visible.unwrap_or_default())
        }
        GpuView::Uneven(why) => {
            tracing::warn!("{task}: {why}");
            why
        }
    };
    tracing::info!("{task}: rank {} of {}, rank 0 at {}; {gpus}", spec.rank, spec.world, spec.master);
    Ok(spec)
}

/// `eval`: the mean loss of saved weights over a token file's first windows.
/// What `eval` reads: a token file, or a text file tokenized by the weights'
/// tokenizer (or --tokenizer).
struct EvalInput {
    data: Option<PathBuf>,
    text: Option<PathBuf>,
    tokenizer: Option<String>,
}

fn eval_command(
    config: ConfigArgs,
    weights: PathBuf,
    input: EvalInput,
    amount: pipewright::train::eval::Amount,
    json: bool,
) -> Result<()> {
    let (c, s) = (config.config.as_deref(), &config.set);
    let (loss, read, data) = match input {
        EvalInput { data: Some(data), .. } => {
            let (loss, read) = pipewright::train::eval::eval_file(c, s, &weights, &data, amount)?;
            (loss, read, data)
        }
        EvalInput { data: None, text, tokenizer } => {
            let text = text.expect("clap requires --data or --text");
            let tok = match tokenizer {
                Some(t) => Some(Tokenizer::from_arg(&t).map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?),
                None => None,
            };
            let (loss, read) = pipewright::train::eval::eval_text(c, s, &weights, &text, tok, amount)?;
            (loss, read, text)
        }
    };
    if json {
        println!("{}", serde_json::json!({ "loss": loss, "windows": read }));
    } else {
        println!("mean loss over the first {read} windows of {}: {loss:.6}", data.display());
    }
    Ok(())
}

/// `generate`: continues a prompt with saved weights, printing tokens as they come.
fn generate_command(
    config: ConfigArgs,
    weights: PathBuf,
    prompt: String,
    max_new_tokens: usize,
    sampling: pipewright::generate::Sampling,
    tokenizer: Option<String>,
) -> Result<()> {
    let tokenizer = match tokenizer {
        Some(t) => Some(Tokenizer::from_arg(&t).map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?),
        None => None,
    };
    let req = pipewright::generate::GenerateRequest {
        config: config.config.as_deref(),
        overrides: &config.set,
        weights: &weights,
        tokenizer,
        prompt: &prompt,
        max_new_tokens,
        sampling,
    };
    pipewright::generate::run(&req, &mut std::io::stdout().lock())?;
    Ok(())
}

/// `bench --transport`: the CPU data plane on loopback.
fn bench_transport(tls: TlsArgs, json: bool) -> Result<()> {
    let tls = tls.load()?;
    let b = pipewright::cluster::bench::transport(20_000, &[1.0, 16.0, 64.0], tls.as_ref())?;
    println!(
        "frame round trip ({} floats, {} trips{}): median {:.1} µs, p99 {:.1} µs",
        b.small_floats,
        b.round_trips,
        if b.tls { ", TLS" } else { "" },
        b.rtt_median_us,
        b.rtt_p99_us
    );
    for (mib, mbs) in &b.bandwidth {
        println!("{mib:>5.0} MiB frames: {mbs:.0} MB/s (one way, decoded)");
    }
    if json {
        println!("{}", serde_json::to_string(&b)?);
    }
    Ok(())
}

/// `bench --sim`: the simulated backend's measured against theoretical bubble, cell by cell.
fn bench_sim(schedule: String, plot: PathBuf, json: bool, mut cells: Vec<(usize, usize)>) -> Result<()> {
    if cells.is_empty() {
        for p in [2, 4, 8, 16, 32] {
            for k in [1, 2, 4, 8] {
                cells.push((p, p * k));
            }
        }
    }
    eprintln!(
        "pipewright bench --sim: {schedule}, F = 2 ms, B = 4 ms (I = W = 2 ms), 6 steps per cell, \
         the median of the last 5"
    );
    // Bar length in expected milliseconds (steps × (m + p − 1) × (F + B)),
    // so the ETA weighs pp = 32, m = 256 as the long cell it is.
    let steps = 6;
    let expected = |&(p, m): &(usize, usize)| (steps * (m + p - 1)) as u64 * 6;
    let bar = if std::io::stderr().is_terminal() {
        indicatif::ProgressBar::new(cells.iter().map(expected).sum())
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30.cyan/blue} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .expect("valid template"),
    );
    let mut rows = Vec::new();
    for (i, cell) in cells.iter().enumerate() {
        bar.set_message(format!("cell {}/{}: pp {} m {}", i + 1, cells.len(), cell.0, cell.1));
        rows.extend(pipewright::bench::sim_rows(&schedule, &[*cell], 2.0, 4.0, steps)?);
        bar.inc(expected(cell));
    }
    bar.finish_and_clear();
    print!("{}", pipewright::bench::sim_table(&rows));
    std::fs::write(&plot, pipewright::bench::sim_plot(&rows))
        .with_context(|| format!("{}: cannot write", plot.display()))?;
    println!("plot: {}", plot.display());
    if json {
        println!("{}", serde_json::to_string(&rows)?);
    }
    Ok(())
}

/// `bench`: training throughput, the pipeline comparison and the runtime's per-message overhead.
fn bench_command(
    config: ConfigArgs,
    steps: Option<usize>,
    warmup: usize,
    pp: Vec<usize>,
    microbatches: usize,
    json: bool,
) -> Result<()> {
    let path = config.config.clone();
    let cfg = config.load(None)?;
    cfg.validate()?;
    // train's own check, so bench refuses what train refuses.
    pipewright::limits::check(&cfg)?;
    let steps = steps.unwrap_or(cfg.train.steps);
    let name = path.map(|p| p.display().to_string()).unwrap_or_else(|| "embedded default".into());
    eprintln!(
        "pipewright bench: {name}: {} layers, {} wide, {} heads, vocab {}, T {}, {} × {} sequences per step",
        cfg.model.n_layer,
        cfg.model.n_embd,
        cfg.model.n_head,
        cfg.model.vocab_size,
        cfg.model.block_size,
        cfg.parallel.microbatches,
        cfg.train.micro_batch_size
    );
    let report = pipewright::bench::run(&cfg, steps, warmup, |s, loss| {
        eprint!("\r  step {s}/{steps} loss {loss:.4}   ");
    });
    eprintln!();
    print!("{}", report.table());
    let rows = if pp.is_empty() {
        vec![]
    } else {
        eprintln!(
            "pipeline comparison: pp = {pp:?}, {microbatches} microbatches of {} sequences per step",
            cfg.train.micro_batch_size
        );
        let rows = pipewright::bench::pipeline_rows(&cfg, steps, &pp, microbatches)?;
        print!("{}", pipewright::bench::pipeline_table(&rows));
        rows
    };
    let (lat_median, lat_p99) = pipewright::bench::message_latency(20_000)?;
    println!(
        "\nper-message overhead of the runtime itself (an idle actor, send → start of its handler, \
         20 000 messages; target ≤ 20 µs median): median {lat_median:.1} µs, p99 {lat_p99:.1} µs"
    );
    if let Some(r) =
        rows.iter().filter(|r| r.messages > 0).max_by(|a, b| a.msg_median_us.total_cmp(&b.msg_median_us))
    {
        println!(
            "send → handle inside a busy run (compute threads on every core; worst layout above, pp = {}): \
             median {:.1} µs, p99 {:.1} µs",
            r.pp, r.msg_median_us, r.msg_p99_us
        );
    }
    if json {
        let mut v = serde_json::to_value(&report).context("report")?;
        v["pipeline"] = serde_json::to_value(&rows)?;
        v["message_latency_median_us"] = lat_median.into();
        v["message_latency_p99_us"] = lat_p99.into();
        println!("{v}");
    }
    Ok(())
}

/// `schedule`: builds, checks and draws a schedule.
fn schedule_command(
    kind: String,
    stages: usize,
    microbatches: usize,
    chunks: Option<usize>,
    json: bool,
    trace: Option<PathBuf>,
    costs: Vec<f64>,
) -> Result<()> {
    // cli_text first: its errors name the flags. --costs draws the grid at those costs.
    let text = pipewright::schedule::cli_text(&kind, stages, microbatches, chunks, json)?;
    if costs.is_empty() || json {
        print_out(&text)?;
    } else {
        print_out(&pipewright::trace::simulated::cli_grid(&kind, stages, microbatches, chunks, &costs)?)?;
    }
    if let Some(path) = trace {
        let v = pipewright::trace::simulated::cli_trace(&kind, stages, microbatches, chunks, &costs)?;
        // A text file ends with a newline (tools that append or diff expect one).
        std::fs::write(&path, format!("{v}\n"))
            .with_context(|| format!("{}: cannot write", path.display()))?;
        eprintln!("trace: {}", path.display());
    }
    Ok(())
}

/// `trace summary`: where a trace's time went.
fn trace_summary(file: PathBuf, json: bool, replica: Option<usize>) -> Result<()> {
    let mut trace = pipewright::trace::summary::load(&file)?;
    if let Some(r) = replica {
        trace = trace.replica(r)?;
    }
    let s = pipewright::trace::summary::summarize(&trace)?;
    if json {
        print_out(&format!("{}\n", serde_json::to_string_pretty(&s.to_json())?))
    } else {
        print_out(&s.text())
    }
}

/// Writes a command's report on stdout. A reader that has what it wanted
/// (`| head`) closes the pipe: that ends the command quietly, as for other
/// tools, where `print!` would panic.
fn print_out(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// One `--cells` entry of `bench --sim`: `PPxM`, both at least 1.
fn parse_cell(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("{s:?}: expected PPxM with whole numbers of at least 1, e.g. 8x32");
    let (p, m) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    let p: usize = p.trim().parse().map_err(|_| bad())?;
    let m: usize = m.trim().parse().map_err(|_| bad())?;
    if p == 0 || m == 0 {
        return Err(bad());
    }
    Ok((p, m))
}

/// `tokenizer train`: a byte-level BPE tokenizer from corpus files.
fn tokenizer_train(a: TokenizerTrainArgs) -> Result<()> {
    let settings = data::tokenizer::TrainSettings {
        vocab_size: a.vocab_size,
        special_tokens: a.special,
        pattern: a.pattern.parse().map_err(|e| anyhow::anyhow!("--pattern: {e}"))?,
        min_frequency: a.min_frequency,
        show_progress: std::io::stderr().is_terminal(),
    };
    let read = data::read::ReadSettings { text_field: a.text_field, skip_bad_lines: a.skip_bad_lines };
    let r = data::prepare::train_tokenizer(&a.input, &read, &settings, &a.out, a.threads, a.force)?;
    println!(
        "{} documents → {} ({} tokens, blake3 {})",
        r.documents,
        r.path.display(),
        r.vocab_size,
        &r.hash[..16]
    );
    Ok(())
}

/// `bench --data`: the data pipeline's stages on a generated corpus, and
/// Python's tokenizers on the same file when --python names an interpreter.
fn bench_data(
    data_dir: &std::path::Path,
    data_mb: u64,
    threads: usize,
    python: Option<PathBuf>,
    json: bool,
) -> Result<()> {
    let exe = std::env::current_exe()?;
    let b = data::bench::run(data_dir, data_mb * 1_000_000, threads, 32_000, &exe)?;
    print!("{}", data::bench::table(&b));
    if let Some(py) = python {
        let out = std::process::Command::new(py)
            .arg("scripts/bench_tokenizers.py")
            .arg(data_dir.join("tokenizer.json"))
            .arg(&b.tokenize_file)
            .env("RAYON_NUM_THREADS", threads.to_string())
            .env("RAYON_RS_NUM_CPUS", threads.to_string())
            .output()?;
        anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
    if json {
        println!("{}", serde_json::to_string(&b)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every argument of every command, nested ones included.
    fn undescribed(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            let builtin = matches!(a.get_id().as_str(), "help" | "version");
            if !builtin && !a.is_hide_set() && a.get_help().is_none() && a.get_long_help().is_none() {
                out.push(format!("{path} {}", a.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            undescribed(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn every_help_argument_is_described() {
        let mut missing = Vec::new();
        undescribed(&Cli::command(), "pipewright", &mut missing);
        assert!(missing.is_empty(), "arguments without a description: {missing:?}");
    }
}
