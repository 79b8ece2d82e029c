//! PyTorch's caching-allocator settings and its size rules (reference §1):
//! request rounding (`round_size`), pool choice and segment sizes
//! (`get_allocation_size`).

use crate::api::{MIN_BLOCK_SIZE, SMALL_SIZE};
use crate::error::AllocError;

/// `kSmallBuffer`: a small-pool segment (and the small-pool expandable page), 2 MiB.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// `kMinLargeAlloc`: large requests below 10 MiB get a [`LARGE_BUFFER`] segment.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// `kLargeBuffer`: the 20 MiB segment (and large-pool expandable page).
pub const LARGE_BUFFER: u64 = 20 << 20;
/// `kRoundLarge`: requests of 10 MiB or more get a segment rounded up to 2 MiB.
pub const ROUND_LARGE: u64 = 2 << 20;
/// Number of `roundup_power2_divisions` buckets (1 MiB … 64 GiB by powers of two).
pub const ROUNDUP_INTERVALS: usize = 16;

/// `roundup_power2_divisions`: how many equal divisions each power-of-two interval
/// is cut into when rounding a request (0 or 1 = off, otherwise a power of two).
///
/// Bucket `i` covers sizes with `⌊log2 size⌋ − 20 == i` (clamped to 0..=15): bucket 0
/// holds everything below 2 MiB, bucket 15 everything from 32 GiB up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundupPower2Divisions(pub [u64; ROUNDUP_INTERVALS]);

impl RoundupPower2Divisions {
    /// Rounding off (PyTorch's default).
    pub const OFF: RoundupPower2Divisions = RoundupPower2Divisions([0; ROUNDUP_INTERVALS]);

    /// The single-value form, `roundup_power2_divisions:d`: every bucket is `d`.
    pub fn uniform(divisions: u64) -> Self {
        RoundupPower2Divisions([divisions; ROUNDUP_INTERVALS])
    }

    /// The list form, `[256:1,512:2,>:8]`: `intervals` holds `(MiB, divisions)` pairs
    /// with power-of-two keys in increasing order; the first key also fills every
    /// lower bucket and `above` (the `>` entry) fills the buckets after the last key.
    pub fn from_intervals(
        intervals: &[(u64, u64)],
        above: Option<u64>,
    ) -> Result<Self, AllocError> {
        let mut out = [0u64; ROUNDUP_INTERVALS];
        let mut last: Option<usize> = None;
        for &(mib, divisions) in intervals {
            if !mib.is_power_of_two() {
                return Err(invalid(
                    mib,
                    "roundup_power2_divisions keys must be powers of two (MiB)",
                ));
            }
            check_divisions(divisions)?;
            let bucket = (mib.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            match last {
                None => out[..=bucket].iter_mut().for_each(|b| *b = divisions),
                Some(prev) if bucket <= prev => {
                    return Err(invalid(mib, "roundup_power2_divisions keys must increase"))
                }
                Some(_) => out[bucket] = divisions,
            }
            last = Some(bucket);
        }
        if let Some(divisions) = above {
            check_divisions(divisions)?;
            let start = last.map_or(0, |b| b + 1);
            out[start.min(ROUNDUP_INTERVALS)..]
                .iter_mut()
                .for_each(|b| *b = divisions);
        }
        Ok(RoundupPower2Divisions(out))
    }

    /// Check every bucket is 0 or a power of two.
    pub fn validate(&self) -> Result<(), AllocError> {
        self.0.iter().try_for_each(|&d| check_divisions(d))
    }

    /// The divisions that apply to a request of `size` bytes (`size > 0`).
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log_size = 63 - size.max(1).leading_zeros() as usize;
        let index = log_size.saturating_sub(20).min(ROUNDUP_INTERVALS - 1);
        self.0[index]
    }
}

fn check_divisions(divisions: u64) -> Result<(), AllocError> {
    if divisions == 0 || divisions.is_power_of_two() {
        Ok(())
    } else {
        Err(invalid(
            divisions,
            "roundup_power2_divisions values must be 0 or a power of two",
        ))
    }
}

fn invalid(size: u64, reason: &'static str) -> AllocError {
    AllocError::InvalidSize { size, reason }
}

/// Settings of a [`super::CachingAllocator`] (a subset of
/// `PYTORCH_CUDA_ALLOC_CONF`). Two presets: [`CachingConfig::classic`]
/// (PyTorch's default configuration, also `Default`) and
/// [`CachingConfig::expandable`] (the same with `expandable_segments:True`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CachingConfig {
    /// `expandable_segments:True`: the `expandable` allocator; off, `classic`.
    pub expandable_segments: bool,
    /// `max_split_size_mb` in bytes (at least 20 MiB); `None` = unlimited.
    /// Blocks this big are never split and never handed to smaller requests.
    pub max_split_size: Option<u64>,
    /// `roundup_power2_divisions` (off by default).
    pub roundup_power2_divisions: RoundupPower2Divisions,
    /// `garbage_collection_threshold` in (0, 1); active only with a memory
    /// fraction (and, as in PyTorch, it never frees expandable memory).
    pub garbage_collection_threshold: Option<f64>,
    /// `set_per_process_memory_fraction` in (0, 1], applied to the device total.
    pub memory_fraction: Option<f64>,
    /// Virtual bytes reserved per expandable segment; `None` = 9/8 of the
    /// device total (PyTorch's rule). Rounded up to whole pages. Only with
    /// `expandable_segments`.
    pub va_reserve_bytes: Option<u64>,
}

impl CachingConfig {
    /// `classic`: PyTorch's default configuration (split blocks in
    /// `cudaMalloc` segments).
    pub fn classic() -> CachingConfig {
        CachingConfig::default()
    }

    /// `expandable`: PyTorch's default configuration with
    /// `expandable_segments:True`.
    pub fn expandable() -> CachingConfig {
        CachingConfig {
            expandable_segments: true,
            ..CachingConfig::default()
        }
    }

    /// The name the allocator reports: `classic` or `expandable`.
    pub fn name(&self) -> &'static str {
        if self.expandable_segments {
            "expandable"
        } else {
            "classic"
        }
    }

    /// Validate and resolve against the device (`mem_info` total).
    pub(crate) fn settings(&self, vmm: &dyn quilt_vmm::Vmm) -> Result<CachingSettings, AllocError> {
        let (max_split_size, gc_threshold, fraction) = validate_common(
            self.max_split_size,
            &self.roundup_power2_divisions,
            self.garbage_collection_threshold,
            self.memory_fraction,
        )?;
        let va_reserve = match self.va_reserve_bytes {
            Some(0) => {
                return Err(invalid(0, "the expandable reservation must be non-zero"));
            }
            Some(va) if !self.expandable_segments => {
                return Err(invalid(
                    va,
                    "va_reserve_bytes applies to expandable segments only",
                ));
            }
            other => other,
        };
        let total = vmm.mem_info()?.total;
        let gran = vmm.granularity().max(1);
        let page = |p: u64| p.div_ceil(gran) * gran;
        Ok(CachingSettings {
            max_split_size,
            max_non_split_rounding_size: LARGE_BUFFER,
            divisions: self.roundup_power2_divisions,
            gc_threshold,
            allowed_memory_maximum: fraction.map(|f| (f * total as f64) as u64),
            expandable: self.expandable_segments,
            large_page: page(LARGE_BUFFER),
            small_page: page(SMALL_BUFFER),
            expandable_va_bytes: va_reserve.unwrap_or(total + total / 8),
            device_total: total,
        })
    }
}

/// The settings shared by the classic and expandable baselines (a subset of
/// `PYTORCH_CUDA_ALLOC_CONF`), already validated.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CachingSettings {
    /// `max_split_size`, `u64::MAX` when unlimited.
    pub max_split_size: u64,
    /// `max_non_split_rounding_size` (20 MiB default).
    pub max_non_split_rounding_size: u64,
    /// `roundup_power2_divisions`.
    pub divisions: RoundupPower2Divisions,
    /// `garbage_collection_threshold`, 0 when off.
    pub gc_threshold: f64,
    /// `allowed_memory_maximum` when a per-process memory fraction is set.
    pub allowed_memory_maximum: Option<u64>,
    /// `expandable_segments:True`.
    pub expandable: bool,
    /// Expandable page of the large pool (`large_segment_size`, 20 MiB).
    pub large_page: u64,
    /// Expandable page of the small pool (2 MiB).
    pub small_page: u64,
    /// Bytes of virtual address space reserved per expandable segment, before
    /// rounding up to whole pages (9/8 of the device total in PyTorch).
    pub expandable_va_bytes: u64,
    /// Device total memory as `mem_info` reported it at construction.
    pub device_total: u64,
}

/// Validate the user-facing knobs and turn them into [`CachingSettings`] fields.
fn validate_common(
    max_split_size: Option<u64>,
    divisions: &RoundupPower2Divisions,
    gc_threshold: Option<f64>,
    memory_fraction: Option<f64>,
) -> Result<(u64, f64, Option<f64>), AllocError> {
    let max_split = match max_split_size {
        None => u64::MAX,
        Some(s) if s < LARGE_BUFFER => {
            return Err(invalid(s, "max_split_size must be at least 20 MiB"));
        }
        Some(s) => s,
    };
    divisions.validate()?;
    let gc = match gc_threshold {
        None => 0.0,
        Some(t) if t > 0.0 && t < 1.0 => t,
        Some(_) => {
            return Err(invalid(
                0,
                "garbage_collection_threshold must lie in (0, 1)",
            ));
        }
    };
    let fraction = match memory_fraction {
        None => None,
        Some(f) if f > 0.0 && f <= 1.0 => Some(f),
        Some(_) => return Err(invalid(0, "memory fraction must lie in (0, 1]")),
    };
    Ok((max_split, gc, fraction))
}

/// `round_size`: the block size a request of `orig` bytes gets (`orig > 0`,
/// at most [`crate::MAX_ALLOCATION`], so nothing here overflows).
pub(crate) fn round_size(orig: u64, divisions: &RoundupPower2Divisions) -> u64 {
    if orig < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let d = divisions.divisions_for(orig);
    if d > 1 && orig > MIN_BLOCK_SIZE * d {
        roundup_power2_next_division(orig, d)
    } else {
        orig.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }
}

/// Round `size` up to the next of `divisions` equal steps between two powers of two.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}

/// Which pool a rounded size belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum PoolKind {
    /// Rounded size ≤ 1 MiB.
    Small = 0,
    /// Rounded size > 1 MiB.
    Large = 1,
}

impl PoolKind {
    /// The pool of a rounded size.
    pub fn of(size: u64) -> PoolKind {
        if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// Index into a two-pool array.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Name used in snapshots.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// `get_allocation_size`: the size of a fresh classic segment for a rounded request.
pub(crate) fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn rounding_matches_the_reference_table() {
        let off = RoundupPower2Divisions::OFF;
        assert_eq!(round_size(1, &off), 512);
        assert_eq!(round_size(1_000_000, &off), 1_000_448);
        assert_eq!(round_size(MIB + 1, &off), 1_049_088);
        assert_eq!(allocation_size(512), 2 * MIB);
        assert_eq!(allocation_size(1_049_088), 20 * MIB);
        assert_eq!(allocation_size(5 * MIB), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB), 10 * MIB);
        assert_eq!(allocation_size(11 * MIB), 12 * MIB);
        assert_eq!(allocation_size(13 * MIB + MIB / 2), 14 * MIB);
        assert_eq!(PoolKind::of(MIB), PoolKind::Small);
        assert_eq!(PoolKind::of(MIB + 512), PoolKind::Large);
    }

    #[test]
    fn power2_divisions_round_as_documented() {
        let four = RoundupPower2Divisions::uniform(4);
        assert_eq!(round_size(600 * MIB, &four), 640 * MIB);
        assert_eq!(round_size(512 * MIB, &four), 512 * MIB);
        assert_eq!(round_size(1000, &four), 1024);
        let list = RoundupPower2Divisions::from_intervals(&[(256, 1), (512, 2)], Some(8)).unwrap();
        assert_eq!(list.divisions_for(100 * MIB), 1);
        assert_eq!(list.divisions_for(600 * MIB), 2);
        assert_eq!(list.divisions_for(2048 * MIB), 8);
        assert!(RoundupPower2Divisions::from_intervals(&[(300, 1)], None).is_err());
        assert!(RoundupPower2Divisions::uniform(3).validate().is_err());
    }
}
