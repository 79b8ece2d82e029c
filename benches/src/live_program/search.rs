//! The smallest device on which a program completes: a bisection over
//! device sizes that are whole multiples of a step, deciding by completion
//! alone (never by time), so the same program gives the same answer.

/// The inputs of a search, all in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// The largest device, a multiple of `step`, on which the program
    /// completed (the first probe).
    pub max: u64,
    /// The resolution: every size probed is a multiple of it.
    pub step: u64,
    /// Below this no run can complete (the peak allocated bytes).
    pub floor: u64,
    /// A size worth probing first (the peak reserved bytes at `max`: where
    /// the allocator completes unless it needs more than it held).
    pub hint: u64,
}

/// The answer and the sizes probed, in order, with whether each completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Search {
    /// The smallest multiple of `step` on which the program completed, one
    /// `step` above a size on which it did not (or on which nothing can).
    pub smallest: u64,
    /// Each probe: (size, completed).
    pub probes: Vec<(u64, bool)>,
}

/// Bisect between the floor and `bounds.max` with `completes`. Assumes that
/// completing is monotone in the device size (what the answer means where
/// it is not: the threshold the bisection found). `completes` is never
/// asked about `bounds.max` (known to complete) or a size below the floor.
pub fn smallest_device<E>(
    bounds: Bounds,
    mut completes: impl FnMut(u64) -> Result<bool, E>,
) -> Result<Search, E> {
    let step = bounds.step.max(1);
    // In steps. Invariant: `lo` fails (or is 0), `hi` completes.
    let mut hi = bounds.max / step;
    let mut lo = bounds
        .floor
        .div_ceil(step)
        .saturating_sub(1)
        .min(hi.saturating_sub(1));
    let mut probes = Vec::new();
    let mut probe = |k: u64, probes: &mut Vec<(u64, bool)>| -> Result<bool, E> {
        let ok = completes(k * step)?;
        probes.push((k * step, ok));
        Ok(ok)
    };
    let hint = bounds.hint.div_ceil(step);
    if lo < hint && hint < hi {
        if probe(hint, &mut probes)? {
            hi = hint;
        } else {
            lo = hint;
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if probe(mid, &mut probes)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Search {
        smallest: hi * step,
        probes,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;

    const MIB: u64 = 1 << 20;

    fn search(threshold: u64, bounds: Bounds) -> Search {
        smallest_device::<()>(bounds, |size| {
            assert!(size >= bounds.floor.div_ceil(bounds.step) * bounds.step - bounds.step);
            assert!(size < bounds.max);
            Ok(size >= threshold)
        })
        .unwrap()
    }

    #[test]
    fn finds_the_threshold_to_the_step() {
        let b = Bounds {
            max: 1024 * MIB,
            step: 2 * MIB,
            floor: 300 * MIB + 5,
            hint: 420 * MIB,
        };
        for threshold in [
            302 * MIB,
            351 * MIB,
            420 * MIB,
            421 * MIB,
            1000 * MIB,
            1024 * MIB,
        ] {
            let s = search(threshold, b);
            assert_eq!(
                s.smallest,
                threshold.div_ceil(2 * MIB) * 2 * MIB,
                "{threshold}"
            );
            // The answer's step below was probed and failed (or is the floor's).
            let below = s.smallest - 2 * MIB;
            assert!(
                s.probes.contains(&(below, false)) || below < b.floor,
                "{threshold}: {:?}",
                s.probes
            );
        }
    }

    #[test]
    fn the_hint_first_then_bisection() {
        let b = Bounds {
            max: 80 << 30,
            step: 2 * MIB,
            floor: 437 * MIB,
            hint: 523 * MIB,
        };
        let s = search(500 * MIB, b);
        assert_eq!(s.probes[0], (524 * MIB, true));
        assert_eq!(s.smallest, 500 * MIB);
        assert!(s.probes.len() <= 7, "{:?}", s.probes);
    }

    #[test]
    fn nothing_to_search_when_the_floor_is_the_top() {
        let b = Bounds {
            max: 64 * MIB,
            step: 64 * MIB,
            floor: 10 * MIB,
            hint: 0,
        };
        let s = search(1, b);
        assert_eq!((s.smallest, s.probes.len()), (64 * MIB, 0));
    }

    #[test]
    fn the_same_answer_every_time() {
        let b = Bounds {
            max: 8 << 30,
            step: 2 * MIB,
            floor: 100 * MIB,
            hint: 3 << 30,
        };
        assert_eq!(search(777 * MIB, b), search(777 * MIB, b));
    }
}
