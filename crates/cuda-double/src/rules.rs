//! What the double models and which of its rules are relaxed, read once from
//! the environment at `cuInit`, so that a real GPU's probe answers
//! (`scripts/gpu-check.sh`) can be mirrored.
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `QUILT_CUDA_DOUBLE_DEVICES` | 1 | number of devices |
//! | `QUILT_CUDA_DOUBLE_MEMORY` | 16 GiB | memory of each device (`cuMemGetInfo`, `cuMemCreate`) |
//! | `QUILT_CUDA_DOUBLE_GRANULARITY` | 2 MiB | minimum granularity (a power of two, at least the host page) |
//! | `QUILT_CUDA_DOUBLE_RECOMMENDED` | the minimum | recommended granularity |
//! | `QUILT_CUDA_DOUBLE_SHAREABLE_GRANULARITY` | the minimum | granularity of allocations that request a shareable handle type |
//! | `QUILT_CUDA_DOUBLE_ADDRESS_SPACE` | 1 TiB | virtual address space all reservations share |
//! | `QUILT_CUDA_DOUBLE_LAG` | 256 | later driver calls after which queued work runs by itself |
//! | `QUILT_CUDA_DOUBLE_POSIX_FD` | 1 | POSIX file-descriptor handles supported |
//! | `QUILT_CUDA_DOUBLE_RDMA` | 1 | `GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED` |
//! | `QUILT_CUDA_DOUBLE_RELAX` | none | comma-separated rules to relax: `map_offset`, `partial_map`, `unmap_spans`, `unmap_waits` |
//! | `QUILT_CUDA_DOUBLE_DRIVER_VERSION` | 12080 | `cuDriverGetVersion` |
//!
//! Relaxed rules: `map_offset` accepts a non-zero `cuMemMap` offset (the
//! reference: it "currently must be zero"); `partial_map` accepts a mapping
//! smaller than its handle; `unmap_spans` accepts one `cuMemUnmap` over
//! several neighbouring mappings; `unmap_waits` makes `cuMemUnmap` and
//! `cuMemRelease` first run the queued work that touches the range (the
//! default is the worst case: the work runs later and faults).

use std::env;

/// The double's model and rules; see the module documentation.
#[derive(Debug, Clone)]
pub struct Rules {
    /// Devices.
    pub devices: i32,
    /// Bytes of memory of each device.
    pub memory: u64,
    /// Minimum granularity.
    pub granularity: u64,
    /// Recommended granularity.
    pub recommended: u64,
    /// Granularity of allocations requesting a shareable handle type.
    pub shareable_granularity: u64,
    /// Bytes of virtual address space for all reservations.
    pub address_space: u64,
    /// Driver calls after which queued work runs by itself.
    pub lag: u64,
    /// POSIX file-descriptor handles supported.
    pub posix_fd: bool,
    /// GPUDirect RDMA with VMM allocations supported.
    pub rdma: bool,
    /// `cuMemMap` accepts a non-zero offset.
    pub map_offset: bool,
    /// `cuMemMap` accepts a size smaller than the handle's.
    pub partial_map: bool,
    /// `cuMemUnmap` accepts several neighbouring mappings.
    pub unmap_spans: bool,
    /// `cuMemUnmap` and `cuMemRelease` run the work queued on the range first.
    pub unmap_waits: bool,
    /// `cuDriverGetVersion`.
    pub driver_version: i32,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            devices: 1,
            memory: 16 << 30,
            granularity: 2 << 20,
            recommended: 2 << 20,
            shareable_granularity: 2 << 20,
            address_space: 1 << 40,
            lag: 256,
            posix_fd: true,
            rdma: true,
            map_offset: false,
            partial_map: false,
            unmap_spans: false,
            unmap_waits: false,
            driver_version: 12080,
        }
    }
}

/// A size with an optional `KiB`/`MiB`/`GiB`/`TiB` suffix.
fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let (digits, shift) = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)]
        .iter()
        .find_map(|(s, k)| t.strip_suffix(s).map(|d| (d, *k)))
        .unwrap_or((t, 0));
    digits.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

impl Rules {
    /// The rules from `QUILT_CUDA_DOUBLE_*`, or the name and value of the
    /// first variable that does not parse.
    pub fn from_env() -> Result<Rules, String> {
        let mut r = Rules::default();
        let size = |name: &str, into: &mut u64| -> Result<(), String> {
            if let Ok(v) = env::var(name) {
                *into = parse_size(&v).ok_or_else(|| format!("{name}={v}: not a size"))?;
            }
            Ok(())
        };
        size("QUILT_CUDA_DOUBLE_MEMORY", &mut r.memory)?;
        size("QUILT_CUDA_DOUBLE_GRANULARITY", &mut r.granularity)?;
        r.recommended = r.granularity;
        r.shareable_granularity = r.granularity;
        size("QUILT_CUDA_DOUBLE_RECOMMENDED", &mut r.recommended)?;
        size(
            "QUILT_CUDA_DOUBLE_SHAREABLE_GRANULARITY",
            &mut r.shareable_granularity,
        )?;
        size("QUILT_CUDA_DOUBLE_ADDRESS_SPACE", &mut r.address_space)?;
        size("QUILT_CUDA_DOUBLE_LAG", &mut r.lag)?;
        let page = rustix::param::page_size() as u64;
        for (name, g) in [
            ("granularity", r.granularity),
            ("recommended granularity", r.recommended),
            ("shareable granularity", r.shareable_granularity),
        ] {
            if !g.is_power_of_two() || g < page {
                return Err(format!(
                    "{name} {g}: must be a power of two, at least {page}"
                ));
            }
        }
        let flag = |name: &str, into: &mut bool| -> Result<(), String> {
            match env::var(name).as_deref() {
                Ok("1") => *into = true,
                Ok("0") => *into = false,
                Ok(v) => return Err(format!("{name}={v}: 0 or 1")),
                Err(_) => {}
            }
            Ok(())
        };
        flag("QUILT_CUDA_DOUBLE_POSIX_FD", &mut r.posix_fd)?;
        flag("QUILT_CUDA_DOUBLE_RDMA", &mut r.rdma)?;
        if let Ok(v) = env::var("QUILT_CUDA_DOUBLE_DEVICES") {
            r.devices = v
                .parse()
                .ok()
                .filter(|d| (0..=16).contains(d))
                .ok_or_else(|| format!("QUILT_CUDA_DOUBLE_DEVICES={v}: 0 to 16"))?;
        }
        if let Ok(v) = env::var("QUILT_CUDA_DOUBLE_DRIVER_VERSION") {
            r.driver_version = v
                .parse()
                .map_err(|_| format!("QUILT_CUDA_DOUBLE_DRIVER_VERSION={v}: an integer"))?;
        }
        if let Ok(v) = env::var("QUILT_CUDA_DOUBLE_RELAX") {
            for rule in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                match rule {
                    "map_offset" => r.map_offset = true,
                    "partial_map" => r.partial_map = true,
                    "unmap_spans" => r.unmap_spans = true,
                    "unmap_waits" => r.unmap_waits = true,
                    other => {
                        return Err(format!(
                            "QUILT_CUDA_DOUBLE_RELAX: unknown rule {other} (map_offset, partial_map, unmap_spans, unmap_waits)"
                        ))
                    }
                }
            }
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_and_without_units() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("2MiB"), Some(2 << 20));
        assert_eq!(parse_size(" 16 GiB"), Some(16 << 30));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("99999999999TiB"), None);
    }
}
