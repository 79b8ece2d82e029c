//! What a backend still holds: the leak report, one type for every backend.

use std::fmt;

use crate::types::{DevicePtr, PhysHandle};

/// Everything still alive on a backend (handles, reservations, mappings,
/// events), each list sorted by handle id or address.
///
/// After a caller has given everything back (every `create` released, every
/// `reserve` freed, every `map` unmapped, every event destroyed), every list is
/// empty and the counts are 0: [`LeakReport::is_empty`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeakReport {
    /// Live physical handles and their sizes: not released, or released but still mapped.
    pub handles: Vec<(PhysHandle, u64)>,
    /// How many of `handles` were released already and live on only because
    /// they are still mapped.
    pub released_but_mapped: usize,
    /// Live address reservations (start, size).
    pub reservations: Vec<(DevicePtr, u64)>,
    /// Live mappings (start, size).
    pub mappings: Vec<(DevicePtr, u64)>,
    /// Events recorded and not destroyed.
    pub events: usize,
}

impl LeakReport {
    /// True when nothing is alive.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
            && self.reservations.is_empty()
            && self.mappings.is_empty()
            && self.events == 0
    }

    /// The same as [`LeakReport::is_empty`].
    pub fn is_clean(&self) -> bool {
        self.is_empty()
    }

    /// Handles not yet released.
    pub fn unreleased_handles(&self) -> usize {
        self.handles.len() - self.released_but_mapped
    }

    /// Bytes of physical memory held by the live handles.
    pub fn handle_bytes(&self) -> u64 {
        self.handles.iter().map(|(_, s)| *s).sum()
    }
}

/// At most this many items of each list are printed.
const SHOWN: usize = 8;

fn list<T: Copy>(
    f: &mut fmt::Formatter<'_>,
    what: &str,
    items: &[T],
    show: impl Fn(T) -> String,
) -> fmt::Result {
    if items.is_empty() {
        return Ok(());
    }
    write!(f, "; {} {what}:", items.len())?;
    for item in items.iter().take(SHOWN) {
        write!(f, " {}", show(*item))?;
    }
    if items.len() > SHOWN {
        write!(f, " ...")?;
    }
    Ok(())
}

impl fmt::Display for LeakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("nothing alive");
        }
        write!(f, "still alive")?;
        list(f, "handle(s)", &self.handles, |(h, s)| {
            format!("#{}({s:#x})", h.0)
        })?;
        if self.released_but_mapped > 0 {
            write!(
                f,
                " ({} released but still mapped)",
                self.released_but_mapped
            )?;
        }
        list(f, "reservation(s)", &self.reservations, |(p, s)| {
            format!("{p:#x}+{s:#x}")
        })?;
        list(f, "mapping(s)", &self.mappings, |(p, s)| {
            format!("{p:#x}+{s:#x}")
        })?;
        if self.events > 0 {
            write!(f, "; {} event(s)", self.events)?;
        }
        Ok(())
    }
}
