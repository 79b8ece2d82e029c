//! `quilt-bench live`: its arguments checked, the run, the report.

use std::path::{Path, PathBuf};

use super::allocator::allocators;
use super::json::{to_json, Parameters};
use super::probe::Runner;
use super::record::{record, Recorded, DEFAULT_ENTRIES};
use super::table::{report, RunContext};
use super::{chart, measure, verdict, Plan};
use crate::cli::{say, write_json, CliError};
use crate::report::rows::version;
use crate::units::parse_size;

/// `scripts/simulated-gpu.sh` of the checkout this bench was built from.
const SIMULATED_GPU: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/simulated-gpu.sh");

/// The checkout's `python` folder (`quilt_torch`).
const QUILT_PYTHON: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../python");

/// The simulated GPU's granularity: device sizes are whole multiples of it.
const GRANULARITY: u64 = 2 << 20;

/// Arguments of `quilt-bench live`.
#[derive(Debug, Clone, clap::Args)]
pub struct LiveArgs {
    /// The Python program to run (as `python PROGRAM.py ARGS...`).
    #[arg(value_name = "PROGRAM.py")]
    pub program: PathBuf,
    /// The program's arguments, after `--`.
    #[arg(last = true, value_name = "ARGS")]
    pub args: Vec<String>,
    /// Allocators, comma-separated [default: classic,expandable,quilt, unless
    /// --allocator is given].
    #[arg(long, value_delimiter = ',')]
    pub allocators: Option<Vec<String>>,
    /// An allocator with settings, `quilt[:KEY=VALUE,...]` with the PyTorch
    /// library's keys (QUILT_ALLOC_CONF's, `backend` and `capacity` aside);
    /// repeatable.
    #[arg(long = "allocator", value_name = "SPEC")]
    pub allocator_specs: Vec<String>,
    /// The largest device (each device of the simulated GPU), with its unit:
    /// the first run of each allocator, and the top of the bisection.
    #[arg(long, default_value = "80GiB")]
    pub max_memory: String,
    /// The bisection's resolution: a multiple of 2 MiB, which --max-memory
    /// is a multiple of.
    #[arg(long, default_value = "2MiB")]
    pub step: String,
    /// Skip the search for the smallest device (one run per allocator).
    #[arg(long)]
    pub no_bisect: bool,
    /// Write the JSON report here (`-`: to standard output, the table then
    /// going to standard error).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the chart into this folder (`<program>-live.svg`).
    #[arg(long, value_name = "DIR")]
    pub svg: Option<PathBuf>,
    /// The Python interpreter, with torch [default: the torch venv's,
    /// $QUILT_TORCH_VENV/bin/python or ~/.cache/quilt/torch-venv/bin/python].
    #[arg(long, value_name = "PY")]
    pub python: Option<PathBuf>,
    /// Also record torch's memory history of a classic run, save it as a
    /// trace in this folder (`<program>.trace`, for `ab --trace`) and replay
    /// it under each allocator beside the live figures.
    #[arg(long, value_name = "DIR")]
    pub record: Option<PathBuf>,
    /// History entries torch records at most with --record.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_ENTRIES)]
    pub record_entries: u64,
}

/// The torch venv's python: `$QUILT_TORCH_VENV/bin/python`, else
/// `~/.cache/quilt/torch-venv/bin/python` (where `scripts/torch-venv.sh`
/// installs it).
pub fn default_python() -> Option<PathBuf> {
    let venv = match std::env::var_os("QUILT_TORCH_VENV") {
        Some(v) => PathBuf::from(v),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/quilt/torch-venv"),
    };
    Some(venv.join("bin").join("python"))
}

/// A size argument with its unit: more than 0, a whole multiple of `of` bytes.
fn size_arg(flag: &str, text: &str, of: u64, of_name: &str) -> Result<u64, CliError> {
    let bytes =
        parse_size(text.trim()).map_err(|e| CliError::Usage(format!("{flag} {text}: {e}")))?;
    if bytes == 0 || bytes % of != 0 {
        return Err(CliError::Usage(format!(
            "{flag} {text}: must be a whole multiple of {of_name}, more than 0"
        )));
    }
    Ok(bytes)
}

/// The plan of `args`, every argument checked (exit status 2 where one is wrong).
fn plan(args: &LiveArgs, scratch: &Path) -> Result<Plan, CliError> {
    if !args.program.is_file() {
        return Err(CliError::Input {
            path: args.program.display().to_string(),
            message: "no such program (quilt-bench live PROGRAM.py [-- ARGS...])".into(),
        });
    }
    let allocators =
        allocators(args.allocators.as_deref(), &args.allocator_specs).map_err(CliError::Usage)?;
    let step = size_arg(
        "--step",
        &args.step,
        GRANULARITY,
        "2 MiB (the device's granularity)",
    )?;
    let max_memory = size_arg("--max-memory", &args.max_memory, step, "--step")?;
    let python = match &args.python {
        Some(p) => p.clone(),
        None => default_python().ok_or_else(|| {
            CliError::Usage(
                "no HOME or QUILT_TORCH_VENV to find the torch venv: give --python".into(),
            )
        })?,
    };
    if python.components().count() > 1 && !python.is_file() {
        return Err(CliError::Input {
            path: python.display().to_string(),
            message: "no Python interpreter there (give --python PY, or run scripts/torch-venv.sh)"
                .into(),
        });
    }
    let simulated_gpu = PathBuf::from(SIMULATED_GPU);
    if !simulated_gpu.is_file() {
        return Err(CliError::Input {
            path: simulated_gpu.display().to_string(),
            message: "the simulated GPU's script is missing from the checkout this bench was \
                      built from"
                .into(),
        });
    }
    if args.record.is_some() && args.record_entries == 0 {
        return Err(CliError::Usage(
            "--record-entries must be at least 1".into(),
        ));
    }
    Ok(Plan {
        runner: Runner {
            python,
            program: args.program.clone(),
            args: args.args.clone(),
            simulated_gpu,
            quilt_python: PathBuf::from(QUILT_PYTHON),
            scratch: scratch.to_path_buf(),
        },
        allocators,
        max_memory,
        step,
        bisect: !args.no_bisect,
    })
}

/// Run `quilt-bench live`.
pub fn run_live(args: &LiveArgs) -> Result<(), CliError> {
    let scratch = std::env::temp_dir().join(format!("quilt-bench-live-{}", std::process::id()));
    let result = run_in(args, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn run_in(args: &LiveArgs, scratch: &Path) -> Result<(), CliError> {
    let plan = plan(args, scratch)?;
    let mut progress = |line: &str| eprintln!("{line}");
    let rows = measure(&plan, &mut progress).map_err(|e| CliError::Output(e.to_string()))?;
    let (recorded, record_error): (Option<Recorded>, Option<String>) = match &args.record {
        None => (None, None),
        Some(dir) => match record(
            &plan.runner,
            dir,
            args.record_entries,
            plan.max_memory,
            &plan.allocators,
            0,
            &mut progress,
        ) {
            Ok(r) => (Some(r), None),
            Err(e) => (None, Some(format!("--record: {e}"))),
        },
    };

    let to_stdout = args.json.as_deref() == Some(Path::new("-"));
    let command = std::iter::once(args.program.display().to_string())
        .chain(args.args.iter().cloned())
        .collect::<Vec<_>>()
        .join(" ");
    let devices = std::env::var("QUILT_CUDA_DOUBLE_DEVICES").unwrap_or_else(|_| "2".into());
    let ctx = RunContext {
        command,
        max_memory: plan.max_memory,
        step: plan.step,
        bisect: plan.bisect,
        devices: devices.clone(),
    };
    say(to_stdout, &report(&rows, &ctx, recorded.as_ref()));
    if let Some(path) = &args.json {
        let parameters = Parameters {
            version: version(),
            program: args.program.display().to_string(),
            args: args.args.clone(),
            python: plan.runner.python.display().to_string(),
            max_memory_bytes: plan.max_memory,
            step_bytes: plan.step,
            bisection: plan.bisect,
            devices,
        };
        let json = to_json(&parameters, &rows, recorded.as_ref())
            .map_err(|e| CliError::Output(e.to_string()))?;
        if let Some(line) = write_json(path, &json)? {
            say(to_stdout, &line);
        }
    }
    if let Some(dir) = &args.svg {
        let stem = args
            .program
            .file_stem()
            .map_or_else(|| "program".into(), |s| s.to_string_lossy().into_owned());
        let file =
            chart::write_chart(dir, &stem, &rows, recorded.as_ref()).map_err(CliError::Output)?;
        say(to_stdout, &format!("chart written: {file}\n"));
    }
    verdict(&rows, plan.max_memory).map_err(CliError::Failed)?;
    match record_error {
        Some(e) => Err(CliError::Failed(e)),
        None => Ok(()),
    }
}
