//! The `quilt-bench` command line: `ab` (the A/B harness), `sweep`, `scale`,
//! `sizes`, `live` (a PyTorch program on the simulated GPU, [`crate::live_program`])
//! and `list`.
//!
//! Exit status: 0 when every pair was measured; 1 when the run finished and
//! wrote its report but something in it failed (a pair failed: its allocator
//! could not be built, the trace was inconsistent, the allocator failed; or
//! every allocator ran out of memory on some workload); 2 when the command
//! could not run (a bad argument, an unreadable or empty input).

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

use crate::live_program::command::{run_live, LiveArgs};
use crate::replay::{ReplayConfig, DEFAULT_GPU_LAG_OPS, DEFAULT_SYNC_COST_NS};
use crate::report::rows::{
    self, distinct, CostModelParameters, Measurement, Outcome, RunParameters,
};
use crate::report::text::{self, Layout, RunContext};
use crate::report::{charts, json};
use crate::snapshot_import::load_snapshot;
use crate::trace::{load_trace, Event, Trace, TraceError};
use crate::units::{parse_size, size_text, SizeError};
use crate::workloads::{self, DEFAULT_SEED, WORKLOADS};
use crate::{ab, allocators, scale, sweep};

/// `quilt-bench`: replay allocation traces through GPU memory allocators on a
/// simulated device and compare them.
#[derive(Debug, Parser)]
#[command(name = "quilt-bench", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay workloads through allocators and compare them (A/B).
    ///
    /// Prints a block per workload with the columns that carry the claims, a
    /// legend and the best allocator per column (`--wide`: every column).
    /// Exit status: 0 when every (workload, allocator) pair was measured; 1
    /// when the report was written but a pair failed (its row says why) or
    /// every allocator ran out of memory on a workload; 2 when an argument or
    /// an input file is wrong.
    Ab(Box<AbArgs>),
    /// One knob of one allocator, one replay per value (and its bisection):
    /// the usual columns per value, JSON rows with `value`, a chart.
    Sweep(Box<SweepArgs>),
    /// Host cost per operation of a steady churn as live blocks and streams
    /// grow: one line (and JSON row) per allocator, live count and streams.
    Scale(ScaleArgs),
    /// Host cost per operation against block size: the churn of `scale`
    /// with every block of one size, one line (and JSON row) per allocator
    /// and size, against the same allocator at the smallest size.
    Sizes(SizesArgs),
    /// Run a PyTorch program on the simulated GPU under each allocator
    /// (torch's classic caching allocator, its expandable segments, Quilt),
    /// each in its own process: torch's peak figures, the smallest device on
    /// which it completes (bisection), driver calls; see docs/benchmarks.md.
    ///
    /// Exit status: 0 when every allocator completed on the largest device;
    /// 1 when the report was written but one did not (the error is in the
    /// report), or --record failed; 2 when an argument is wrong (a missing
    /// program, a bad spec).
    Live(Box<LiveArgs>),
    /// List the built-in workloads with their figures.
    List {
        /// Seed of the generators.
        #[arg(long, default_value_t = DEFAULT_SEED)]
        seed: u64,
        /// Also print each workload's size mix (allocations and bytes by size class).
        #[arg(long)]
        sizes: bool,
    },
}

/// Arguments of `quilt-bench scale`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScaleArgs {
    /// Allocator specs, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "quilt,classic")]
    pub allocators: Vec<String>,
    /// Live block counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,100000")]
    pub live: Vec<u64>,
    /// Stream counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    pub streams: Vec<u64>,
    /// Timed steps per point (each a free and an allocate).
    #[arg(long, default_value_t = 20_000)]
    pub steps: u64,
    /// Runs per point, round robin over the points; each point reports the
    /// median of its runs.
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Seed of the sizes and choices.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    pub seed: u64,
    /// Write the JSON rows (`allocator`, `live`, `streams`, `ns_per_op`,
    /// `driver_ns_per_op`, `stream_calls_per_op`, ...) here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Arguments of `quilt-bench sizes`.
#[derive(Debug, Clone, clap::Args)]
pub struct SizesArgs {
    /// Allocator specs, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "quilt,classic")]
    pub allocators: Vec<String>,
    /// Block sizes, with their units, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "2MiB,4MiB,8MiB,16MiB,32MiB,64MiB,128MiB,256MiB,512MiB,1GiB"
    )]
    pub sizes: Vec<String>,
    /// Live blocks kept, all of the point's size.
    #[arg(long, default_value_t = 16)]
    pub live: u64,
    /// Streams the blocks are spread over.
    #[arg(long, default_value_t = 1)]
    pub streams: u64,
    /// Timed steps per point (each a free and an allocate).
    #[arg(long, default_value_t = 5_000)]
    pub steps: u64,
    /// Runs per point, round robin over the points; each point reports the
    /// median of its runs.
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Seed of the choices.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    pub seed: u64,
    /// Write the JSON rows (those of `scale`, with `size_bytes`) here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// What every replaying command shares: the device, the loop, the report
/// files, the bisection, the simulated GPU.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Simulated device capacity of the main replay, with its unit: 80GiB,
    /// 1.5GiB, 512MiB, 4096B (a number without a unit is refused).
    #[arg(long, default_value = "80GiB")]
    pub capacity: String,
    /// Times the non-pre-existing part of each trace is replayed.
    #[arg(long, default_value_t = 1)]
    pub iterations: u32,
    /// Write the JSON report (`{"parameters": {...}, "rows": [...]}`) here;
    /// `-`: to standard output, the table then going to standard error.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Print every column (one line per workload and allocator, wider than
    /// 100 characters) instead of the claims.
    #[arg(long)]
    pub wide: bool,
    /// Write SVG charts into this folder.
    #[arg(long, value_name = "DIR")]
    pub svg: Option<PathBuf>,
    /// Skip the minimum-capacity bisection (min_capacity_bytes is null).
    #[arg(long)]
    pub no_bisect: bool,
    /// Seed of the built-in workload generators.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    pub seed: u64,
    /// Worker threads (default: the machine's parallelism).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// How many allocator operations the simulated GPU runs behind the host:
    /// work queued on a stream completes this many operations later (0: at
    /// once). See docs/benchmarks.md for the default.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_GPU_LAG_OPS)]
    pub gpu_lag_ops: u64,
    /// Modelled cost of one stream synchronisation (a pipeline drain), in
    /// microseconds.
    #[arg(long, value_name = "US", default_value_t = DEFAULT_SYNC_COST_NS as f64 / 1000.0)]
    pub sync_cost_us: f64,
}

/// Arguments of `quilt-bench sweep`.
#[derive(Debug, Clone, clap::Args)]
pub struct SweepArgs {
    /// A built-in workload (this or --trace).
    #[arg(long, value_name = "NAME")]
    pub workload: Option<String>,
    /// A trace file (this or --workload).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// The allocator spec whose knob is varied (`NAME[:KEY=VALUE,...]`).
    #[arg(long, value_name = "SPEC", default_value = "quilt")]
    pub allocator: String,
    /// The knob and its values: `KEY=V1,V2,...` (each value is set in the
    /// spec in turn, replacing a setting of the same key).
    #[arg(long, value_name = "KEY=V1,V2,...")]
    pub vary: String,
    /// The replay and its report.
    #[command(flatten)]
    pub run: RunArgs,
}

/// A sweep's result: the key, its values, the run's parameters and one
/// outcome per value, in order.
pub type SweepResult = (String, Vec<String>, RunParameters, Vec<Outcome>);

/// Run a sweep: the A/B of the one trace through the spec with each value.
pub fn run_sweep(args: &SweepArgs) -> Result<SweepResult, CliError> {
    let (key, values) = sweep::parse_vary(&args.vary).map_err(CliError::Usage)?;
    let (workloads, traces) = match (&args.workload, &args.trace) {
        (Some(w), None) => (vec![w.clone()], vec![]),
        (None, Some(t)) => (vec![], vec![t.clone()]),
        _ => {
            return Err(CliError::Usage(
                "sweep takes one of --workload NAME or --trace FILE".into(),
            ))
        }
    };
    let specs: Vec<String> = values
        .iter()
        .map(|v| sweep::with_setting(&args.allocator, &key, v))
        .collect();
    let ab = AbArgs {
        workloads,
        traces,
        snapshots: vec![],
        allocators: Some(vec![]),
        allocator_specs: specs,
        export_snapshot: None,
        check_every: None,
        // The sweep writes its own report and chart.
        run: RunArgs {
            json: None,
            svg: None,
            ..args.run.clone()
        },
    };
    let (parameters, outcomes) = run_ab(&ab)?;
    Ok((key, values, parameters, outcomes))
}

/// Arguments of `quilt-bench ab`.
#[derive(Debug, Clone, clap::Args)]
pub struct AbArgs {
    /// Built-in workloads (repeatable, or several after one flag); see `quilt-bench list`.
    #[arg(long = "workload", value_name = "NAME", num_args = 1..)]
    pub workloads: Vec<String>,
    /// Trace files in the text format (repeatable, or several after one flag).
    #[arg(long = "trace", value_name = "FILE", num_args = 1..)]
    pub traces: Vec<PathBuf>,
    /// PyTorch memory snapshot pickles (repeatable, or several after one flag).
    #[arg(long = "snapshot", value_name = "FILE", num_args = 1..)]
    pub snapshots: Vec<PathBuf>,
    /// Allocators to compare, comma-separated [default: quilt,classic,expandable,gmlake,offset,
    /// unless --allocator is given].
    #[arg(long, value_delimiter = ',')]
    pub allocators: Option<Vec<String>>,
    /// An allocator with settings changed, `NAME[:KEY=VALUE[,KEY=VALUE...]]`
    /// (repeatable; e.g. `quilt:reclaim=always`, `gmlake:frag_limit=32MiB`,
    /// `quilt:page_size=20MiB`); reported as given. A bad key lists the valid ones.
    #[arg(long = "allocator", value_name = "SPEC")]
    pub allocator_specs: Vec<String>,
    /// Write, for every workload and allocator, a snapshot pickle in PyTorch's
    /// layout (`torch.cuda.memory._snapshot()`, for PyTorch's memory viewer)
    /// of the memory as the main replay left it, into this folder, as
    /// `WORKLOAD__ALLOCATOR.pickle`.
    #[arg(long, value_name = "DIR")]
    pub export_snapshot: Option<PathBuf>,
    /// Check the allocator's invariants every K events (slow; for debugging).
    #[arg(long, value_name = "K")]
    pub check_every: Option<usize>,
    /// The replay and its report.
    #[command(flatten)]
    pub run: RunArgs,
}

/// `--sync-cost-us` in nanoseconds: a finite, non-negative number of
/// microseconds, rounded to the nanosecond.
pub fn sync_cost_ns(us: f64) -> Result<u64, CliError> {
    if !us.is_finite() || us < 0.0 {
        return Err(CliError::Usage(format!(
            "--sync-cost-us must be a finite number of microseconds, 0 or more (got {us})"
        )));
    }
    let ns = (us * 1000.0).round();
    if ns > u64::MAX as f64 {
        return Err(CliError::Usage(format!("--sync-cost-us {us} is too large")));
    }
    Ok(ns as u64)
}

/// Why a command failed: [`CliError::Failed`] exits with status 1 (the
/// report was written), every other variant with status 2 (nothing ran).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// An argument is wrong.
    #[error("{0}")]
    Usage(String),
    /// A size could not be parsed.
    #[error(transparent)]
    Size(#[from] SizeError),
    /// A trace or snapshot file cannot be replayed: unreadable, malformed,
    /// of the other format, or empty.
    #[error("{path}: {message}")]
    Input {
        /// The file.
        path: String,
        /// What is wrong, and what to do.
        message: String,
    },
    /// A report could not be written.
    #[error("{0}")]
    Output(String),
    /// The run finished and its report was written, but something in it
    /// failed (a pair, or every allocator on a workload).
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    /// The process exit status of this error: 1 for [`CliError::Failed`], else 2.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Failed(_) => 1,
            _ => 2,
        }
    }
}

/// `--capacity`: a size with its unit (`80GiB`, `1.5GiB`, `512MiB`,
/// `4096B`), more than 0 bytes. A bare number is refused: `1.5` is far more
/// likely meant as GiB than as one byte.
pub fn parse_capacity(text: &str) -> Result<u64, CliError> {
    let t = text.trim();
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(CliError::Usage(if t.contains('.') {
            format!("--capacity {t}: give a unit, e.g. {t}GiB, 80GiB or 512MiB")
        } else {
            format!("--capacity {t}: give a unit, e.g. 80GiB or 512MiB ({t}B for bytes)")
        }));
    }
    let bytes = parse_size(t)?;
    if bytes == 0 {
        return Err(CliError::Usage(
            "--capacity must be more than 0 bytes".into(),
        ));
    }
    Ok(bytes)
}

/// Where a report goes: `--json -` sends the JSON to standard output and
/// everything else to standard error.
pub(crate) fn say(json_to_stdout: bool, text: &str) {
    if json_to_stdout {
        eprint!("{text}");
    } else {
        out(text);
    }
}

/// Write `text` to standard output. A reader that stopped reading (`| head`)
/// is not an error: the rest of the report is dropped, as a Unix tool's is,
/// instead of the panic `print!` would raise; any other failure to write
/// standard output goes to standard error.
fn out(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("error: writing the report to standard output: {e}");
        }
        _ => {}
    }
}

/// Write `json` to `path` (`-`: standard output); the line saying where it
/// went, if anywhere.
pub(crate) fn write_json(path: &Path, json: &str) -> Result<Option<String>, CliError> {
    if path == Path::new("-") {
        out(&format!("{json}\n"));
        return Ok(None);
    }
    write_json_file(path, json).map(Some)
}

/// Write `json` to the file `path`; the line saying where it went.
fn write_json_file(path: &Path, json: &str) -> Result<String, CliError> {
    std::fs::write(path, format!("{json}\n"))
        .map_err(|e| CliError::Output(format!("{}: {e}", path.display())))?;
    Ok(format!("JSON written to {}\n", path.display()))
}

/// What failed in a finished run: pairs that failed, and workloads on which
/// every allocator ran out of memory. `Ok` when nothing did.
fn run_verdict(outcomes: &[Outcome], capacity: u64) -> Result<(), CliError> {
    let mut problems = Vec::new();
    let failed = outcomes.iter().filter(|o| o.is_err()).count();
    if failed > 0 {
        problems.push(format!(
            "{failed} of {} (workload, allocator) pairs failed (see FAILED above)",
            outcomes.len()
        ));
    }
    let measured = outcomes.iter().filter_map(|o| o.as_ref().ok());
    for w in distinct(measured.map(|m| m.row.workload.as_str())) {
        let rows: Vec<&Measurement> = outcomes
            .iter()
            .filter_map(|o| o.as_ref().ok())
            .filter(|m| m.row.workload == w)
            .collect();
        if rows.iter().all(|m| !m.row.completed) {
            let least = rows.iter().filter_map(|m| m.row.min_capacity_bytes).min();
            problems.push(format!(
                "every allocator ran out of memory on {w} at {}: nothing completed to \
                 compare; give a larger --capacity{}",
                size_text(capacity),
                least.map_or_else(String::new, |b| format!(" (at least {})", size_text(b)))
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CliError::Failed(problems.join("; ")))
    }
}

/// Run `quilt-bench sizes`: the points, their table, their JSON.
fn run_sizes(args: &SizesArgs) -> Result<(), CliError> {
    for a in &args.allocators {
        allocators::check_name(a).map_err(|e| CliError::Usage(e.to_string()))?;
    }
    if args.live == 0 || args.streams == 0 || args.steps == 0 || args.repeat == 0 {
        return Err(CliError::Usage(
            "--live, --streams, --steps and --repeat must be at least 1".into(),
        ));
    }
    let mut sizes = Vec::new();
    for s in &args.sizes {
        match parse_size(s) {
            Ok(0) => return Err(CliError::Usage(format!("--sizes: {s:?} is no block"))),
            Ok(bytes) => sizes.push(bytes),
            Err(e) => return Err(CliError::Usage(format!("--sizes: {s:?}: {e}"))),
        }
    }
    let specs: Vec<scale::PointSpec> = args
        .allocators
        .iter()
        .flat_map(|a| {
            sizes.iter().map(|&size| scale::PointSpec {
                allocator: a.clone(),
                live: args.live,
                streams: args.streams,
                size: Some(size),
            })
        })
        .collect();
    let (points, failed) = scale::run_points(&specs, args.steps, args.seed, args.repeat);
    out(&text::sizes_table(&points));
    for f in &failed {
        out(&format!("failed: {f}\n"));
    }
    if let Some(path) = &args.json {
        let json = json::scale_json(&points).map_err(|e| CliError::Output(e.to_string()))?;
        out(&write_json_file(path, &json)?);
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CliError::Output(format!(
            "{} point(s) failed",
            failed.len()
        )))
    }
}

/// Run a parsed command; the report goes to stdout, progress to stderr.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Live(args) => run_live(&args),
        Command::List { seed, sizes } => {
            out(&text::list(seed, sizes));
            Ok(())
        }
        Command::Scale(args) => {
            for a in &args.allocators {
                allocators::check_name(a).map_err(|e| CliError::Usage(e.to_string()))?;
            }
            if args.live.contains(&0)
                || args.streams.contains(&0)
                || args.steps == 0
                || args.repeat == 0
            {
                return Err(CliError::Usage(
                    "--live, --streams, --steps and --repeat must be at least 1".into(),
                ));
            }
            let mut specs = Vec::new();
            for a in &args.allocators {
                for &live in &args.live {
                    for &streams in &args.streams {
                        specs.push(scale::PointSpec {
                            allocator: a.clone(),
                            live,
                            streams,
                            size: None,
                        });
                    }
                }
            }
            let (points, failed) = scale::run_points(&specs, args.steps, args.seed, args.repeat);
            out(&text::scale_table(&points));
            for f in &failed {
                out(&format!("failed: {f}\n"));
            }
            if let Some(path) = &args.json {
                let json =
                    json::scale_json(&points).map_err(|e| CliError::Output(e.to_string()))?;
                out(&write_json_file(path, &json)?);
            }
            if failed.is_empty() {
                Ok(())
            } else {
                Err(CliError::Output(format!(
                    "{} point(s) failed",
                    failed.len()
                )))
            }
        }
        Command::Sizes(args) => run_sizes(&args),
        Command::Sweep(args) => {
            let (key, values, parameters, outcomes) = run_sweep(&args)?;
            let to_stdout = json_to_stdout(&args.run);
            say(to_stdout, &text_report(&outcomes, &args.run, &parameters));
            if let Some(path) = &args.run.json {
                let json = json::sweep_json(&parameters, &key, &values, &outcomes)
                    .map_err(|e| CliError::Output(e.to_string()))?;
                if let Some(line) = write_json(path, &json)? {
                    say(to_stdout, &line);
                }
            }
            if let Some(dir) = &args.run.svg {
                let file = charts::write_sweep_chart(dir, &key, &values, &outcomes)
                    .map_err(CliError::Output)?;
                say(to_stdout, &format!("chart written: {file}\n"));
            }
            run_verdict(&outcomes, parameters.capacity_bytes)
        }
        Command::Ab(args) => {
            let (parameters, outcomes) = run_ab(&args)?;
            let to_stdout = json_to_stdout(&args.run);
            say(to_stdout, &text_report(&outcomes, &args.run, &parameters));
            if let Some(path) = &args.run.json {
                let json = json::to_json(&parameters, &outcomes)
                    .map_err(|e| CliError::Output(e.to_string()))?;
                if let Some(line) = write_json(path, &json)? {
                    say(to_stdout, &line);
                }
            }
            if let Some(dir) = &args.run.svg {
                let measurements: Vec<Measurement> = outcomes
                    .iter()
                    .filter_map(|o| o.as_ref().ok())
                    .cloned()
                    .collect();
                let files = charts::write_charts(dir, &measurements, args.run.iterations)
                    .map_err(|e| CliError::Output(e.to_string()))?;
                let mut text = format!("charts written into {}:\n", dir.display());
                for file in &files {
                    let name = Path::new(file).file_name().map(|f| f.to_string_lossy());
                    text.push_str(&format!("  {}\n", name.unwrap_or_default()));
                }
                say(to_stdout, &text);
            }
            run_verdict(&outcomes, parameters.capacity_bytes)
        }
    }
}

/// Whether `--json -` sends the JSON to standard output.
fn json_to_stdout(run: &RunArgs) -> bool {
    run.json.as_deref() == Some(Path::new("-"))
}

/// The text report of a run in the layout `--wide` picks.
fn text_report(outcomes: &[Outcome], run: &RunArgs, parameters: &RunParameters) -> String {
    let layout = if run.wide {
        Layout::Wide
    } else {
        Layout::Narrow
    };
    let ctx = RunContext {
        capacity_bytes: parameters.capacity_bytes,
        iterations: parameters.iterations,
        gpu_lag_ops: run.gpu_lag_ops,
        sync_cost_us: run.sync_cost_us,
        bisection: parameters.bisection,
    };
    text::report(outcomes, layout, &ctx)
}

/// Load every trace the arguments name (all built-in workloads when none).
/// Names are made unique (`name`, `name-2`, ...) in the order given.
pub fn collect_traces(args: &AbArgs) -> Result<Vec<Trace>, CliError> {
    let mut traces = Vec::new();
    for name in &args.workloads {
        let w = workloads::find(name).ok_or_else(|| {
            CliError::Usage(format!(
                "unknown workload `{name}` (known: {})",
                WORKLOADS.map(|w| w.name).join(", ")
            ))
        })?;
        traces.push((w.generate)(args.run.seed));
    }
    for path in &args.traces {
        let mut trace = load_trace_file(path)?;
        trace.preexisting = preexisting_from_stats(path)?.unwrap_or(0);
        traces.push(trace);
    }
    for path in &args.snapshots {
        traces.push(load_snapshot_file(path)?);
    }
    if args.workloads.is_empty() && args.traces.is_empty() && args.snapshots.is_empty() {
        traces.extend(WORKLOADS.iter().map(|w| (w.generate)(args.run.seed)));
    }
    // Reports key rows by workload name: a name seen before gets a suffix.
    let mut seen = std::collections::HashSet::new();
    for trace in &mut traces {
        let base = trace.name.clone();
        let mut n = 1;
        while !seen.insert(trace.name.clone()) {
            n += 1;
            trace.name = format!("{base}-{n}");
        }
    }
    Ok(traces)
}

/// The first bytes of `path` (for telling formats apart), or the error
/// naming the file.
fn head(path: &Path) -> Result<Vec<u8>, CliError> {
    use std::io::Read;
    let input = |message: String| CliError::Input {
        path: path.display().to_string(),
        message,
    };
    let mut head = Vec::with_capacity(512);
    std::fs::File::open(path)
        .and_then(|f| f.take(512).read_to_end(&mut head))
        .map_err(|e| input(e.to_string()))?;
    Ok(head)
}

/// A pickle starts with the PROTO opcode (protocol 2 and later).
fn looks_like_pickle(head: &[u8]) -> bool {
    head.first() == Some(&0x80)
}

/// JSON starts with `{` or `[`.
fn looks_like_json(head: &[u8]) -> bool {
    matches!(
        head.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{' | b'[')
    )
}

/// A text trace: text whose first line starts with a one-letter event kind.
fn looks_like_text_trace(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head);
    let Some(line) = text.lines().map(str::trim).find(|l| !l.is_empty()) else {
        return false;
    };
    let kind = line.split_ascii_whitespace().next().unwrap_or("");
    kind.len() == 1 && kind.chars().all(|c| c.is_ascii_lowercase())
}

/// `TraceError` as the message of a [`CliError::Input`] on `path` (its I/O
/// variant names the file already).
fn input_error(path: &Path, e: TraceError) -> CliError {
    let message = match e {
        TraceError::Io { source, .. } => source.to_string(),
        other => other.to_string(),
    };
    CliError::Input {
        path: path.display().to_string(),
        message,
    }
}

/// A text trace given by `--trace`: read, with errors naming the file, a
/// hint when it is a pickle or JSON, and an error when it allocates nothing.
pub fn load_trace_file(path: &Path) -> Result<Trace, CliError> {
    let input = |message: String| CliError::Input {
        path: path.display().to_string(),
        message,
    };
    let head = head(path)?;
    if looks_like_pickle(&head) {
        return Err(input(
            "a pickle, not a text trace: give PyTorch memory snapshots with --snapshot".into(),
        ));
    }
    if looks_like_json(&head) {
        let stats = path.file_name().is_some_and(|f| f == "stats.json");
        return Err(input(if stats {
            "not a trace: this stats.json lists the converted traces beside it (their \
             pre-existing allocations are read from it); give the traces: --trace DIR/*.trace"
                .into()
        } else {
            "JSON, not a trace: --trace takes the text format (`a ID SIZE STREAM`, `f ID`)".into()
        }));
    }
    let trace = load_trace(path).map_err(|e| input_error(path, e))?;
    if !trace
        .events
        .iter()
        .any(|e| matches!(e, Event::Alloc { .. }))
    {
        return Err(input(
            "no allocation in this trace: nothing to replay".into(),
        ));
    }
    Ok(trace)
}

/// A PyTorch snapshot given by `--snapshot`: read, with errors naming the
/// file, a hint when it is a text trace, and an error when it recorded no
/// allocation history.
pub fn load_snapshot_file(path: &Path) -> Result<Trace, CliError> {
    let input = |message: String| CliError::Input {
        path: path.display().to_string(),
        message,
    };
    let head = head(path)?;
    if !looks_like_pickle(&head) {
        return Err(input(if looks_like_text_trace(&head) {
            "a text trace, not a snapshot pickle: give text traces with --trace".into()
        } else {
            "not a pickle (a PyTorch snapshot, torch.cuda.memory._snapshot(), is one)".into()
        }));
    }
    let trace = load_snapshot(path).map_err(|e| input_error(path, e))?;
    // Without history the import holds only the blocks live at the snapshot
    // (its pre-existing prefix): nothing happened to replay.
    if trace.events.len() <= trace.preexisting {
        return Err(input(
            "the snapshot recorded no allocation history: nothing to replay (call \
             torch.cuda.memory._record_memory_history() before the work, then _snapshot())"
                .into(),
        ));
    }
    Ok(trace)
}

/// The pre-existing prefix of a converted trace, from the `stats.json` beside it
/// (`preexisting_allocs` of the entry whose `file` is the trace's file name).
/// `None` when there is no `stats.json` or no entry for the file.
pub fn preexisting_from_stats(trace_path: &Path) -> Result<Option<usize>, CliError> {
    let Some(dir) = trace_path.parent() else {
        return Ok(None);
    };
    let stats_path = dir.join("stats.json");
    let Ok(text) = std::fs::read_to_string(&stats_path) else {
        return Ok(None);
    };
    let bad = |m: String| CliError::Output(format!("{}: {m}", stats_path.display()));
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let file_name = trace_path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Some(entries) = value.as_array() else {
        return Err(bad("expected a list of trace entries".into()));
    };
    for entry in entries {
        if entry.get("file").and_then(|f| f.as_str()) == Some(file_name.as_str()) {
            return match entry.get("preexisting_allocs").and_then(|p| p.as_u64()) {
                Some(n) => Ok(Some(n as usize)),
                None => Err(bad(format!(
                    "entry for {file_name} lacks preexisting_allocs"
                ))),
            };
        }
    }
    Ok(None)
}

/// The allocators of an A/B, in report order: `--allocators` (by default
/// all five unless `--allocator` is given), then each `--allocator` spec;
/// each checked.
pub fn allocator_specs(args: &AbArgs) -> Result<Vec<String>, CliError> {
    let mut specs: Vec<String> = match &args.allocators {
        Some(list) => list.clone(),
        None if args.allocator_specs.is_empty() => allocators::ALLOCATOR_NAMES
            .iter()
            .map(|n| n.to_string())
            .collect(),
        None => Vec::new(),
    };
    specs.extend(args.allocator_specs.iter().cloned());
    if specs.is_empty() {
        return Err(CliError::Usage("--allocators names none".into()));
    }
    for (i, a) in specs.iter().enumerate() {
        allocators::check_name(a).map_err(|e| CliError::Usage(e.to_string()))?;
        if specs[..i].contains(a) {
            return Err(CliError::Usage(format!("allocator `{a}` is named twice")));
        }
    }
    Ok(specs)
}

/// Run the A/B: every trace through every allocator, at the given capacity,
/// plus the minimum-capacity bisection unless turned off ([`ab::measure_all`]:
/// pairs on `--jobs` worker threads, outcomes in (trace, allocator) order, a
/// pair that failed as a [`rows::Failure`]), with the run's parameters.
pub fn run_ab(args: &AbArgs) -> Result<(RunParameters, Vec<Outcome>), CliError> {
    let capacity = parse_capacity(&args.run.capacity)?;
    if args.run.iterations == 0 {
        return Err(CliError::Usage("--iterations must be at least 1".into()));
    }
    let specs = allocator_specs(args)?;
    let sync_cost_ns = sync_cost_ns(args.run.sync_cost_us)?;
    let traces = collect_traces(args)?;
    let config = ReplayConfig {
        iterations: args.run.iterations,
        check_every: args.check_every,
        record_series: args.run.svg.is_some(),
        time_ops: true,
        gpu_lag_ops: args.run.gpu_lag_ops,
        sync_cost_ns,
        find_races: true,
    };
    let out = ab::measure_all(&ab::Plan {
        traces: &traces,
        specs: &specs,
        capacity,
        config: &config,
        no_bisect: args.run.no_bisect,
        jobs: args.run.jobs,
        export_snapshot: args.export_snapshot.as_deref(),
    })
    .map_err(CliError::Output)?;
    let parameters = RunParameters {
        version: rows::version(),
        allocators: specs,
        workloads: traces.iter().map(|t| t.name.clone()).collect(),
        capacity_bytes: capacity,
        iterations: args.run.iterations,
        seed: args.run.seed,
        bisection: !args.run.no_bisect,
        cost_model: CostModelParameters::of(&config.sim_config(capacity)),
    };
    Ok((parameters, out))
}
