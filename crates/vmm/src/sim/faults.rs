//! Fault injection: make chosen driver calls fail as the real driver would.

use crate::error::VmmError;
use crate::types::CallKind;

/// When an armed [`Fault`] fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultTrigger {
    /// Fail the `n`th call of the fault's kind counted from when it was armed
    /// (1-based), then disarm. `Nth(0)` never fires and is dropped when armed.
    Nth(u64),
    /// Fail every call of the fault's kind while armed (until
    /// [`super::SimVmm::clear_faults`]).
    Always,
    /// Fail the `k`th VMM call of any kind (see [`CallKind::is_vmm`]: reserve,
    /// address-free, create, release, map, unmap, set-access) counted from when it
    /// was armed (1-based), then disarm. The fault's `kind` is ignored. With no
    /// explicit error the call fails as CUDA does: `CUDA_ERROR_OUT_OF_MEMORY` for
    /// create, `CUDA_ERROR_INVALID_VALUE` for every other kind. Meant for
    /// hardening sweeps: run a workload once to count its calls, then once per
    /// `k` failing call `k`, and check the caller stays consistent.
    NthCallOfAnyKind(u64),
}

/// A fault to arm with [`super::SimVmm::inject`].
///
/// A firing fault makes the call fail before any state changes; the call is
/// still counted (as a failure) in [`crate::DriverStats`] and costed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The kind of call to fail (ignored by [`FaultTrigger::NthCallOfAnyKind`]).
    pub kind: CallKind,
    /// When to fail it.
    pub trigger: FaultTrigger,
    /// The error to return; `None` means the error CUDA gives for that call
    /// (see [`cuda_error_for`]).
    pub error: Option<VmmError>,
}

impl Fault {
    /// Fail the `n`th call of `kind` (1-based, from now) with CUDA's error for it.
    pub fn nth(kind: CallKind, n: u64) -> Fault {
        Fault {
            kind,
            trigger: FaultTrigger::Nth(n),
            error: None,
        }
    }

    /// Fail every call of `kind` while armed, with CUDA's error for it.
    pub fn always(kind: CallKind) -> Fault {
        Fault {
            kind,
            trigger: FaultTrigger::Always,
            error: None,
        }
    }

    /// Fail the `k`th VMM call of any kind (1-based, from now) with CUDA's error
    /// for that call's kind (see [`FaultTrigger::NthCallOfAnyKind`]).
    pub fn nth_overall(k: u64) -> Fault {
        Fault {
            kind: CallKind::Reserve,
            trigger: FaultTrigger::NthCallOfAnyKind(k),
            error: None,
        }
    }

    /// The same fault, returning `error` instead of CUDA's error.
    pub fn with_error(mut self, error: VmmError) -> Fault {
        self.error = Some(error);
        self
    }
}

/// The error the CUDA driver returns when a call of `kind` fails for want of
/// resources: `CUDA_ERROR_OUT_OF_MEMORY` (2) for create, `CUDA_ERROR_INVALID_VALUE`
/// (1) for every other kind.
pub fn cuda_error_for(kind: CallKind) -> VmmError {
    let (code, name, text) = match kind {
        CallKind::Create => (
            2,
            "CUDA_ERROR_OUT_OF_MEMORY",
            "out of memory (injected fault)",
        ),
        _ => (
            1,
            "CUDA_ERROR_INVALID_VALUE",
            "invalid argument (injected fault)",
        ),
    };
    VmmError::Driver {
        call: kind,
        code,
        name: name.to_string(),
        text: text.to_string(),
    }
}

/// An armed fault and the calls it has counted.
#[derive(Clone, Debug)]
struct Armed {
    fault: Fault,
    seen: u64,
}

/// The set of armed faults.
#[derive(Clone, Debug, Default)]
pub(crate) struct FaultSet {
    armed: Vec<Armed>,
}

impl FaultSet {
    /// Arm `fault`.
    pub(crate) fn arm(&mut self, fault: Fault) {
        let never = matches!(
            fault.trigger,
            FaultTrigger::Nth(0) | FaultTrigger::NthCallOfAnyKind(0)
        );
        if !never {
            self.armed.push(Armed { fault, seen: 0 });
        }
    }

    /// Disarm every fault.
    pub(crate) fn clear(&mut self) {
        self.armed.clear();
    }

    /// Faults still armed.
    pub(crate) fn len(&self) -> usize {
        self.armed.len()
    }

    /// Count a call of `kind` against every armed fault and return the error of
    /// the first that fires (every `Nth` fault that reaches its count disarms,
    /// even when an earlier fault's error is the one returned).
    pub(crate) fn check(&mut self, kind: CallKind) -> Option<VmmError> {
        if self.armed.is_empty() {
            return None;
        }
        let mut fired: Option<VmmError> = None;
        self.armed.retain_mut(|armed| {
            let (hit, keep) = match armed.fault.trigger {
                FaultTrigger::Always => (armed.fault.kind == kind, true),
                FaultTrigger::Nth(n) if armed.fault.kind == kind => {
                    armed.seen += 1;
                    (armed.seen == n, armed.seen < n)
                }
                FaultTrigger::Nth(_) => (false, true),
                FaultTrigger::NthCallOfAnyKind(k) if kind.is_vmm() => {
                    armed.seen += 1;
                    (armed.seen == k, armed.seen < k)
                }
                FaultTrigger::NthCallOfAnyKind(_) => (false, true),
            };
            if hit && fired.is_none() {
                fired = Some(match &armed.fault.error {
                    Some(error) => error.clone(),
                    None => cuda_error_for(kind),
                });
            }
            keep
        });
        fired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_nth_faults_due_on_the_same_call_both_disarm_and_the_first_wins() {
        let mut set = FaultSet::default();
        let custom = VmmError::Unavailable {
            reason: crate::Unavailability::NoVmm { ordinal: 1 },
        };
        set.arm(Fault::nth(CallKind::Map, 2).with_error(custom.clone()));
        set.arm(Fault::nth_overall(2));
        assert_eq!(set.len(), 2);
        assert_eq!(set.check(CallKind::Map), None);
        // Not a VMM call: counted by neither.
        assert_eq!(set.check(CallKind::EventRecord), None);
        assert_eq!(set.check(CallKind::Map), Some(custom));
        assert_eq!(set.len(), 0);
        assert_eq!(set.check(CallKind::Map), None);
    }

    #[test]
    fn nth_counts_only_its_kind_and_always_stays() {
        let mut set = FaultSet::default();
        set.arm(Fault::nth(CallKind::Create, 2));
        set.arm(Fault::always(CallKind::Unmap));
        set.arm(Fault::nth(CallKind::Map, 0));
        assert_eq!(set.len(), 2, "Nth(0) is never armed");
        assert_eq!(set.check(CallKind::Create), None);
        assert_eq!(set.check(CallKind::Map), None);
        assert_eq!(
            set.check(CallKind::Create),
            Some(cuda_error_for(CallKind::Create))
        );
        for _ in 0..3 {
            assert_eq!(
                set.check(CallKind::Unmap),
                Some(cuda_error_for(CallKind::Unmap))
            );
        }
        assert_eq!(set.len(), 1);
        set.clear();
        assert_eq!(set.check(CallKind::Unmap), None);
    }

    #[test]
    fn cuda_errors_are_out_of_memory_for_create_and_invalid_value_otherwise() {
        for kind in CallKind::ALL {
            let err = cuda_error_for(kind);
            assert_eq!(err.call(), Some(kind));
            assert_eq!(err.is_out_of_memory(), kind == CallKind::Create, "{kind}");
        }
    }
}
