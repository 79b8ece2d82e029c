//! One run of the program on the simulated GPU at one device size: the
//! process (`scripts/simulated-gpu.sh PYTHON PROGRAM ARGS...`) with the
//! allocator's environment and the Python hook (`benches/live/sitecustomize.py`,
//! written into the run's scratch folder and put first on `PYTHONPATH`), and
//! what its processes reported at exit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::allocator::LiveAllocator;
use super::calls::CallKinds;

/// The hook every Python process of a run imports at start-up.
pub const HOOK: &str = include_str!("../../live/sitecustomize.py");

/// How the program is run: everything but the allocator and the device size.
#[derive(Clone, Debug)]
pub struct Runner {
    /// The Python interpreter (with torch).
    pub python: PathBuf,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// `scripts/simulated-gpu.sh`.
    pub simulated_gpu: PathBuf,
    /// The checkout's `python` folder (`quilt_torch`).
    pub quilt_python: PathBuf,
    /// A folder of this run's own: the hook, and a folder per probe.
    pub scratch: PathBuf,
}

/// Why the program gave no answer at all (the bench's fault or the
/// machine's, not the program's: a program that fails is a [`Probe`] that
/// did not complete).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The process could not be started or waited for, or its scratch
    /// folder not written.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A process's report is not the hook's JSON.
    #[error("{path}: not a report of the live hook: {message}")]
    Report {
        /// The report file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// What an uncaught exception (or the exit) said.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramError {
    /// The exception's type (`OutOfMemoryError`), or `exit` where no
    /// process reported one.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its first line.
    pub message: String,
    /// Whether it is an out-of-memory error.
    pub oom: bool,
}

/// The figures of a run, from torch's `memory_stats()` and the double's
/// counters of every process that reported.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Figures {
    /// `allocated_bytes.all.peak`, the largest over processes and devices.
    pub peak_allocated_bytes: u64,
    /// `reserved_bytes.all.peak`, the largest over processes and devices.
    pub peak_reserved_bytes: u64,
    /// `num_ooms`, summed over processes and devices.
    pub num_ooms: u64,
    /// `num_alloc_retries`, summed.
    pub num_alloc_retries: u64,
    /// `num_sync_all_streams`, summed.
    pub num_sync_all_streams: u64,
    /// Driver calls by kind ([`CallKinds::of`] the entry points').
    pub calls: CallKinds,
    /// Driver calls by entry point, summed over processes.
    pub driver_calls: BTreeMap<String, u64>,
}

/// One run of the program.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Probe {
    /// The device size (`QUILT_CUDA_DOUBLE_MEMORY`), bytes.
    pub memory_bytes: u64,
    /// Whether the program exited with status 0.
    pub completed: bool,
    /// Its exit status (`None`: killed by a signal).
    pub exit_code: Option<i32>,
    /// The error of the first process that reported one (the program's
    /// own process first), or the exit status.
    pub error: Option<ProgramError>,
    /// Processes that reported (the program's and the Python children it
    /// started that used CUDA or not).
    pub processes: usize,
    /// The figures.
    pub figures: Figures,
    /// Seconds from start to exit.
    pub wall_s: f64,
    /// The program's process's snapshot pickle, where recorded.
    #[serde(skip)]
    pub snapshot: Option<PathBuf>,
}

/// A process's report, as the hook writes it.
#[derive(Debug, Deserialize)]
struct Report {
    pid: u32,
    error: Option<ProgramError>,
    devices: Vec<BTreeMap<String, u64>>,
    driver_calls: Option<BTreeMap<String, u64>>,
    stats_error: Option<String>,
}

/// Figures of torch's statistics keys.
fn stat(device: &BTreeMap<String, u64>, key: &str) -> u64 {
    device.get(key).copied().unwrap_or(0)
}

impl Runner {
    /// Write the hook into the scratch folder (once per run).
    pub fn prepare(&self) -> Result<(), ProbeError> {
        let dir = self.hook_dir();
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(dir.join("sitecustomize.py"), HOOK))
            .map_err(|source| ProbeError::Io {
                what: format!("writing the hook into {}", dir.display()),
                source,
            })
    }

    fn hook_dir(&self) -> PathBuf {
        self.scratch.join("hook")
    }

    /// Run the program once under `allocator` on devices of `memory` bytes;
    /// with `record`, torch's memory history is recorded (that many entries
    /// at most) and the snapshot kept. `n` numbers the probe's folder.
    pub fn run(
        &self,
        allocator: &LiveAllocator,
        memory: u64,
        record: Option<u64>,
        n: usize,
    ) -> Result<Probe, ProbeError> {
        let dir = self.scratch.join(format!("probe-{n}"));
        let io = |what: String| move |source| ProbeError::Io { what, source };
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let stdout = std::fs::File::create(dir.join("stdout.txt"))
            .map_err(io(format!("creating {}", dir.display())))?;
        let stderr = std::fs::File::create(dir.join("stderr.txt"))
            .map_err(io(format!("creating {}", dir.display())))?;

        let mut python_path = std::env::join_paths([self.hook_dir(), self.quilt_python.clone()])
            .map_err(|e| ProbeError::Io {
                what: "PYTHONPATH".into(),
                source: std::io::Error::other(e),
            })?;
        if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            python_path.push(":");
            python_path.push(old);
        }
        let mut cmd = Command::new("bash");
        cmd.arg(&self.simulated_gpu)
            .arg(&self.python)
            .arg(&self.program)
            .args(&self.args)
            .env("QUILT_CUDA_DOUBLE_MEMORY", memory.to_string())
            .env("QUILT_LIVE_REPORT_DIR", &dir)
            .env("PYTHONPATH", python_path)
            .env_remove("QUILT_LIVE_RECORD_ENTRIES")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        let (set, remove) = allocator.environment();
        for k in remove {
            cmd.env_remove(k);
        }
        for (k, v) in set {
            cmd.env(k, v);
        }
        if let Some(entries) = record {
            cmd.env("QUILT_LIVE_RECORD_ENTRIES", entries.to_string());
        }
        let start = Instant::now();
        let mut child = cmd.spawn().map_err(io(format!(
            "starting bash {} {}",
            self.simulated_gpu.display(),
            self.python.display()
        )))?;
        let pid = child.id();
        let status = child
            .wait()
            .map_err(io(format!("waiting for {}", self.program.display())))?;
        let wall_s = start.elapsed().as_secs_f64();

        let reports = read_reports(&dir)?;
        let mut figures = Figures::default();
        let mut error = None;
        // The program's own process first, then the others by pid.
        let mut ordered: Vec<&Report> = reports.iter().collect();
        ordered.sort_by_key(|r| (r.pid != pid, r.pid));
        for r in &ordered {
            for d in &r.devices {
                figures.peak_allocated_bytes = figures
                    .peak_allocated_bytes
                    .max(stat(d, "allocated_bytes.all.peak"));
                figures.peak_reserved_bytes = figures
                    .peak_reserved_bytes
                    .max(stat(d, "reserved_bytes.all.peak"));
                figures.num_ooms += stat(d, "num_ooms");
                figures.num_alloc_retries += stat(d, "num_alloc_retries");
                figures.num_sync_all_streams += stat(d, "num_sync_all_streams");
            }
            for (name, calls) in r.driver_calls.iter().flatten() {
                *figures.driver_calls.entry(name.clone()).or_insert(0) += calls;
            }
            if error.is_none() {
                error = r.error.clone();
            }
            if let (None, Some(why)) = (&error, &r.stats_error) {
                error = Some(ProgramError {
                    kind: "stats".into(),
                    message: format!("torch.cuda.memory_stats() failed: {why}"),
                    oom: false,
                });
            }
        }
        figures.calls = CallKinds::of(&figures.driver_calls);
        let completed = status.success();
        if error.is_none() && !completed {
            error = Some(ProgramError {
                kind: "exit".into(),
                message: format!(
                    "{}{}",
                    status.code().map_or_else(
                        || "killed by a signal".to_string(),
                        |c| format!("exit status {c}")
                    ),
                    last_line(&dir.join("stderr.txt"))
                        .map_or_else(String::new, |l| format!(": {l}"))
                ),
                oom: false,
            });
        }
        let snapshot = dir.join(format!("{pid}.pickle"));
        Ok(Probe {
            memory_bytes: memory,
            completed,
            exit_code: status.code(),
            error,
            processes: reports.len(),
            figures,
            wall_s,
            snapshot: snapshot.is_file().then_some(snapshot),
        })
    }

    /// Remove a probe's folder (its snapshot too).
    pub fn forget(&self, n: usize) {
        let _ = std::fs::remove_dir_all(self.scratch.join(format!("probe-{n}")));
    }
}

/// The reports in `dir` (`<pid>.json`).
fn read_reports(dir: &Path) -> Result<Vec<Report>, ProbeError> {
    let entries = std::fs::read_dir(dir).map_err(|source| ProbeError::Io {
        what: format!("reading {}", dir.display()),
        source,
    })?;
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let bad = |message: String| ProbeError::Report {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        out.push(serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?);
    }
    Ok(out)
}

/// The last non-empty line of a file, if any.
fn last_line(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(|l| l.chars().take(300).collect())
}
