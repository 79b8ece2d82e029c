//! Driver-call latency micro-benchmark (see `quilt_bench::latency`).
//!
//! ```text
//! cargo run --release -p quilt-bench --example driver_latency -- [options]
//!   --backend auto|cuda|host   auto (default): CUDA when it constructs, else host
//!   --device N                 CUDA device ordinal (default 0)
//!   --iters N                  pages in the page lifecycle (default 1000)
//!   --batch N                  pages alive at once (default: all on CUDA, 250 on host)
//!   --large-iters N            cycles of the large-handle loop (default 200)
//!   --large-mib N              large handle size in MiB (default 64)
//!   --page-mib N               page size in MiB (default 2)
//!   --warmup N                 untimed warm-up cycles (default 5)
//!   --out FILE                 also write the Markdown table to FILE
//! ```
//!
//! Prints a Markdown section (heading, conditions, table of median / p99 /
//! mean / max in microseconds per call) that `docs/benchmarks.md` can take as
//! is. On the host backend the figures are the host's `mmap` emulation,
//! labelled as such, not GPU figures.

use std::process::ExitCode;

use quilt_bench::latency::{measure, LatencyConfig};
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::Vmm;

const MIB: u64 = 1 << 20;

struct Args {
    backend: String,
    device: usize,
    batch: Option<usize>,
    out: Option<String>,
    config: LatencyConfig,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        backend: "auto".to_owned(),
        device: 0,
        batch: None,
        out: None,
        config: LatencyConfig::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || -> Result<u64, String> {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--backend" => args.backend = value.clone(),
            "--device" => args.device = number()? as usize,
            "--iters" => args.config.iters = number()? as usize,
            "--batch" => args.batch = Some(number()? as usize),
            "--large-iters" => args.config.large_iters = number()? as usize,
            "--large-mib" => args.config.large_size = number()? * MIB,
            "--page-mib" => args.config.page_size = number()? * MIB,
            "--warmup" => args.config.warmup = number()? as usize,
            "--out" => args.out = Some(value.clone()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(args)
}

fn open(args: &Args) -> Result<(Box<dyn Vmm>, String), String> {
    let cuda = |device: usize| -> Result<(Box<dyn Vmm>, String), String> {
        let v = CudaVmm::new(device).map_err(|e| e.to_string())?;
        let version = v.driver_version();
        let description = format!(
            "{}, device {}, CUDA driver {}.{}, {} GiB",
            v.device_name(),
            device,
            version / 1000,
            (version % 1000) / 10,
            v.total_memory() >> 30
        );
        Ok((Box::new(v), description))
    };
    let host = |config: &LatencyConfig| -> Result<(Box<dyn Vmm>, String), String> {
        let pages = config.iters as u64 * config.page_size;
        let v = HostVmm::new(HostConfig {
            granularity: 2 * MIB,
            capacity: pages + 2 * config.large_size + 64 * MIB,
        })
        .map_err(|e| e.to_string())?;
        Ok((
            Box::new(v),
            "host emulation with memfd + mmap on the CPU, not GPU figures".to_owned(),
        ))
    };
    match args.backend.as_str() {
        "cuda" => cuda(args.device),
        "host" => host(&args.config),
        "auto" => cuda(args.device).or_else(|why| {
            eprintln!("driver_latency: CUDA unavailable ({why}); measuring the host backend");
            host(&args.config)
        }),
        other => Err(format!("unknown backend {other} (auto, cuda or host)")),
    }
}

fn main() -> ExitCode {
    let mut args = match parse() {
        Ok(a) => a,
        Err(why) => {
            if !why.is_empty() {
                eprintln!("driver_latency: {why}");
            }
            eprintln!(
                "usage: driver_latency [--backend auto|cuda|host] [--device N] [--iters N] \
                 [--batch N] [--large-iters N] [--large-mib N] [--page-mib N] [--warmup N] [--out FILE]"
            );
            return ExitCode::from(2);
        }
    };
    let (vmm, description) = match open(&args) {
        Ok(v) => v,
        Err(why) => {
            eprintln!("driver_latency: {why}");
            return ExitCode::FAILURE;
        }
    };
    // All pages alive at once on CUDA (as kvcached's bench_vmm); batches of
    // 250 on the host, to stay clear of low open-file limits (one memfd per page).
    args.config.batch = args.batch.unwrap_or(if vmm.backend_name() == "cuda" {
        args.config.iters
    } else {
        args.config.iters.min(250)
    });
    let report = match measure(&*vmm, &description, &args.config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("driver_latency: a driver call failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let markdown = report.to_markdown();
    print!("{markdown}");
    let stats = vmm.driver_stats();
    println!(
        "\n{} VMM calls through the backend, {} failed, {:.1} ms measured inside them.",
        stats.vmm_calls(),
        stats.failed.iter().sum::<u64>(),
        stats.measured_ns as f64 / 1e6
    );
    if let Some(path) = &args.out {
        if let Err(e) = std::fs::write(path, &markdown) {
            eprintln!("driver_latency: cannot write {path}: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
