//! A text summary of an allocator's memory, in the spirit of
//! `torch.cuda.memory_summary()`: one table for any allocator behind
//! [`DeviceAllocator`].

use std::fmt;

use quilt_vmm::CallKind;

use crate::api::DeviceAllocator;
use crate::error::OomReport;
use crate::stats::{AllocatorStats, Stat};

/// Inner width of the table (between the outer `|`): a name and four
/// figures of up to 11 characters each (`1023.99 MiB`).
const WIDTH: usize = 79;

/// What [`DeviceAllocator::memory_summary`] prints: the allocator's
/// statistics and its last out-of-memory report, taken at one moment.
/// Its [`Display`](fmt::Display) is the table.
///
/// Figures shown, in PyTorch's vocabulary ([`AllocatorStats`]): allocated,
/// requested, reserved, active and inactive-split bytes (current, peak,
/// total added, total removed); *cached* bytes, reserved but not allocated
/// (current only); live allocations, active blocks, segments (Quilt:
/// physical chunks of its page pool) and inactive-split blocks; out-of-memory
/// errors, retries and cross-stream waits; the driver calls of the backend by
/// kind (failures in brackets) with the modelled and measured driver time;
/// and the last out-of-memory report, if any.
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::baselines::offset::{OffsetAllocator, OffsetConfig};
/// use quilt_alloc::summary::MemorySummary;
/// use quilt_alloc::DeviceAllocator;
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(64 << 20)?);
/// let alloc = OffsetAllocator::new(vmm, OffsetConfig::default())?;
/// let a = alloc.allocate(4 << 20, StreamId::DEFAULT)?;
/// let _ = alloc.allocate(1 << 30, StreamId::DEFAULT); // out of memory
/// let summary = MemorySummary::of(&alloc);
/// assert_eq!(summary.stats.allocated_bytes.current, 4 << 20);
/// assert_eq!(summary.last_oom.as_ref().map(|r| r.requested), Some(1 << 30));
/// let text = summary.to_string();
/// assert!(text.contains("Allocated memory") && text.contains("4.00 MiB"));
/// assert!(text.contains("Last out-of-memory error"));
/// # alloc.free(a.ptr)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemorySummary {
    /// The allocator's name.
    pub allocator: String,
    /// Its statistics, driver calls included.
    pub stats: AllocatorStats,
    /// Its last out-of-memory report ([`DeviceAllocator::last_oom`]).
    pub last_oom: Option<OomReport>,
}

impl MemorySummary {
    /// The summary of `alloc` now.
    pub fn of<A: DeviceAllocator + ?Sized>(alloc: &A) -> MemorySummary {
        MemorySummary {
            allocator: alloc.name().to_string(),
            stats: alloc.stats(),
            last_oom: alloc.last_oom(),
        }
    }

    /// Bytes reserved from the driver and not allocated: free pages, cached
    /// blocks, and blocks waiting on other streams' work.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::{DeviceAllocator, MemorySummary};
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let a = alloc.allocate(8 << 20, StreamId::DEFAULT)?;
    /// alloc.free(a.ptr)?; // cached, not given back
    /// let summary = MemorySummary::of(&alloc);
    /// assert_eq!(summary.cached_bytes(), summary.stats.reserved_bytes.current);
    /// assert!(summary.cached_bytes() >= 8 << 20);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cached_bytes(&self) -> u64 {
        self.stats
            .reserved_bytes
            .current
            .saturating_sub(self.stats.allocated_bytes.current)
    }
}

/// `bytes` in the largest binary unit that keeps it at least 1, two decimals
/// (whole bytes below 1 KiB), as the summary shows them.
///
/// ```
/// use quilt_alloc::summary::format_bytes;
///
/// assert_eq!(format_bytes(512), "512 B");
/// assert_eq!(format_bytes(3 << 19), "1.50 MiB");
/// assert_eq!(format_bytes(80 << 30), "80.00 GiB");
/// ```
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

fn rule(f: &mut fmt::Formatter<'_>, c: char) -> fmt::Result {
    writeln!(f, "|{}|", c.to_string().repeat(WIDTH))
}

/// `text` as rows of the table, broken at spaces; rows after the first
/// indented by two spaces.
fn line(f: &mut fmt::Formatter<'_>, text: &str) -> fmt::Result {
    for (i, l) in wrap(text, WIDTH - 4).iter().enumerate() {
        let indent = if i == 0 { "" } else { "  " };
        writeln!(f, "| {:<w$} |", format!("{indent}{l}"), w = WIDTH - 2)?;
    }
    Ok(())
}

fn stat_row(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    s: &Stat,
    show: impl Fn(u64) -> String,
) -> fmt::Result {
    writeln!(
        f,
        "| {:<21} | {:>11} | {:>11} | {:>11} | {:>11} |",
        name,
        show(s.current),
        show(s.peak),
        show(s.allocated),
        show(s.freed)
    )
}

/// `text` broken at spaces into lines of at most `width` characters.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for word in text.split_whitespace() {
        if !current.is_empty() && current.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(word);
    }
    if !current.is_empty() {
        lines.push(current);
    }
    lines
}

impl fmt::Display for MemorySummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        rule(f, '=')?;
        writeln!(
            f,
            "|{:^w$}|",
            format!("{} memory summary", self.allocator),
            w = WIDTH
        )?;
        rule(f, '-')?;
        line(
            f,
            &format!(
                "OOMs: {}, alloc retries: {}, cross-stream waits: {}",
                s.num_ooms, s.num_alloc_retries, s.num_stream_waits
            ),
        )?;
        rule(f, '=')?;
        writeln!(
            f,
            "| {:<21} | {:>11} | {:>11} | {:>11} | {:>11} |",
            "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
        )?;
        rule(f, '-')?;
        stat_row(f, "Allocated memory", &s.allocated_bytes, format_bytes)?;
        stat_row(f, "Requested memory", &s.requested_bytes, format_bytes)?;
        stat_row(f, "Reserved memory", &s.reserved_bytes, format_bytes)?;
        stat_row(f, "Active memory", &s.active_bytes, format_bytes)?;
        stat_row(
            f,
            "Inactive split memory",
            &s.inactive_split_bytes,
            format_bytes,
        )?;
        writeln!(
            f,
            "| {:<21} | {:>11} | {:>11} | {:>11} | {:>11} |",
            "Cached memory",
            format_bytes(self.cached_bytes()),
            "",
            "",
            ""
        )?;
        rule(f, '-')?;
        let count = |n: u64| n.to_string();
        stat_row(f, "Allocations", &s.allocation, count)?;
        stat_row(f, "Active blocks", &s.active, count)?;
        stat_row(f, "Segments", &s.segment, count)?;
        stat_row(f, "Inactive split blocks", &s.inactive_split, count)?;
        rule(f, '-')?;
        let d = &s.driver;
        let total: u64 = d.calls.iter().sum();
        let failed: u64 = d.failed.iter().sum();
        line(
            f,
            &format!(
                "Driver calls: {total} ({} VMM, {failed} failed); driver time: \
                 modelled {:.3} ms, measured {:.3} ms",
                d.vmm_calls(),
                d.modelled_ns as f64 / 1e6,
                d.measured_ns as f64 / 1e6
            ),
        )?;
        let by_kind: Vec<String> = CallKind::ALL
            .iter()
            .filter(|k| d.count(**k) > 0)
            .map(|k| match d.failed[k.index()] {
                0 => format!("{k} {}", d.count(*k)),
                n => format!("{k} {} ({n} failed)", d.count(*k)),
            })
            .collect();
        if !by_kind.is_empty() {
            line(f, &format!("By kind: {}", by_kind.join(", ")))?;
        }
        rule(f, '-')?;
        match &self.last_oom {
            None => line(f, "Last out-of-memory error: none")?,
            Some(report) => line(f, &format!("Last out-of-memory error: {report}"))?,
        }
        rule(f, '=')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_in_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(300 << 20), "300.00 MiB");
        assert_eq!(format_bytes(80 << 30), "80.00 GiB");
    }

    #[test]
    fn wrapping_keeps_every_word_within_the_width() {
        let text = "a bb ccc dddd eeeee ffffff";
        let lines = wrap(text, 8);
        assert!(lines.iter().all(|l| l.len() <= 8), "{lines:?}");
        assert_eq!(lines.join(" "), text);
    }
}
