//! Byte sizes on the command line (`80GiB`, `512MiB`, `1.5GiB`, `1000000`) and
//! in reports.

pub use quilt_alloc::units::{parse_size, SizeError};

/// Bytes as GiB with two decimals.
pub fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}

/// Bytes with their unit, for messages: MiB below a GiB, else GiB, two decimals.
pub fn size_text(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{} GiB", gib(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4096B").unwrap(), 4096);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size(" 3 MiB ").unwrap(), 3 << 20);
        assert_eq!(parse_size(".5KiB").unwrap(), 512);
        assert_eq!(parse_size("1.0000000001B").unwrap(), 1);
    }

    #[test]
    fn rejects_bad_sizes() {
        for bad in [
            "",
            "GiB",
            "80XB",
            "1.2.3GiB",
            "-5",
            "99999999999999999999",
            "20000000TiB",
            "1e9",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} parsed");
        }
    }
}
