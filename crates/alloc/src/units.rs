//! Byte sizes written by people (`80GiB`, `512MiB`, `1.5GiB`, `1000000`): on
//! command lines and in configuration strings such as `QUILT_ALLOC_CONF`.

/// A size that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad size `{text}`: {reason} (examples: 80GiB, 512MiB, 1.5GiB, 4096)")]
pub struct SizeError {
    /// What was given.
    pub text: String,
    /// Why it is not a size.
    pub reason: &'static str,
}

/// Parse a byte size: a decimal number (with an optional fraction) and an
/// optional unit, case-insensitive: `B`; `K`/`KiB`, `M`/`MiB`, `G`/`GiB`,
/// `T`/`TiB` (powers of 1024); `KB`, `MB`, `GB`, `TB` (powers of 1000). A
/// fraction of a byte is rounded down. Overflow past `u64` is an error.
///
/// ```
/// use quilt_alloc::units::parse_size;
///
/// assert_eq!(parse_size("80GiB").unwrap(), 80 << 30);
/// assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
/// assert_eq!(parse_size("4096").unwrap(), 4096);
/// assert!(parse_size("1.5").is_ok() && parse_size("lots").is_err());
/// ```
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError {
        text: text.to_string(),
        reason,
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(err("unknown unit")),
    };
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(err("no number"));
    }
    if frac_part.contains('.') {
        return Err(err("more than one decimal point"));
    }
    let whole: u64 = if int_part.is_empty() {
        0
    } else {
        int_part.parse().map_err(|_| err("number too large"))?
    };
    let mut bytes = whole.checked_mul(unit).ok_or_else(|| err("too large"))?;
    if !frac_part.is_empty() {
        // Up to 18 fractional digits are exact in u128 arithmetic; more are ignored.
        let digits: String = frac_part.chars().take(18).collect();
        let frac: u128 = digits.parse().map_err(|_| err("bad fraction"))?;
        let scale = 10u128.pow(digits.len() as u32);
        let extra = frac * u128::from(unit) / scale;
        bytes = u64::try_from(extra)
            .ok()
            .and_then(|e| bytes.checked_add(e))
            .ok_or_else(|| err("too large"))?;
    }
    Ok(bytes)
}
