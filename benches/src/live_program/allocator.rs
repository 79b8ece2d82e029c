//! The allocators of the live A/B and how a Python process is set up for
//! each: `classic` (torch's caching allocator, the default environment),
//! `expandable` (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) and
//! `quilt[:KEY=VALUE,...]` (`quilt_torch.enable()` with
//! `QUILT_ALLOC_CONF=backend:cuda,KEY:VALUE,...`: the PyTorch library's keys,
//! [`quilt_alloc::settings::library`], checked here before anything runs).

use quilt_alloc::settings;

/// The allocators `live` measures when none is named.
pub const DEFAULT_ALLOCATORS: [&str; 3] = ["classic", "expandable", "quilt"];

/// One allocator of a live run, as its spec named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveAllocator {
    /// The spec as given (how reports name it).
    pub spec: String,
    /// Which allocator.
    pub kind: Kind,
}

/// The three allocators a live run can use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// torch's caching allocator: `PYTORCH_CUDA_ALLOC_CONF` unset.
    Classic,
    /// torch's expandable segments.
    Expandable,
    /// Quilt through `quilt_torch.enable()`, with this `QUILT_ALLOC_CONF`.
    Quilt {
        /// `backend:cuda` and the spec's settings, `key:value,...`.
        conf: String,
    },
}

impl LiveAllocator {
    /// Parse a spec: `classic`, `expandable`, or `quilt[:KEY=VALUE,...]`
    /// with the PyTorch library's keys (not `backend` or `capacity`: the
    /// backend is the simulated GPU's driver). The error says what is valid.
    pub fn parse(spec: &str) -> Result<LiveAllocator, String> {
        let (name, pairs) = settings::split_spec(spec).map_err(|e| e.to_string())?;
        let kind = match name {
            "classic" | "expandable" if !pairs.is_empty() => {
                return Err(format!(
                    "`{name}` takes no settings in the live A/B (it is torch's own allocator, \
                     run as torch runs it)"
                ))
            }
            "classic" => Kind::Classic,
            "expandable" => Kind::Expandable,
            "quilt" => {
                if let Some((k, _)) = pairs
                    .iter()
                    .find(|(k, _)| matches!(*k, "backend" | "capacity"))
                {
                    return Err(format!(
                        "`{k}` cannot be set: Quilt runs with backend:cuda on the simulated GPU, \
                         whose device size the bisection sets"
                    ));
                }
                let mut conf = String::from("backend:cuda");
                for (k, v) in &pairs {
                    conf.push_str(&format!(",{k}:{v}"));
                }
                // The library's own parser, as the process will read it.
                settings::library(&conf).map_err(|e| e.to_string())?;
                Kind::Quilt { conf }
            }
            other => {
                return Err(format!(
                    "unknown allocator `{other}` (the live A/B runs classic, expandable and \
                     quilt[:KEY=VALUE,...])"
                ))
            }
        };
        Ok(LiveAllocator {
            spec: spec.to_string(),
            kind,
        })
    }

    /// The name the Python hook reads (`QUILT_LIVE_ALLOCATOR`).
    pub fn hook_name(&self) -> &'static str {
        match self.kind {
            Kind::Classic => "classic",
            Kind::Expandable => "expandable",
            Kind::Quilt { .. } => "quilt",
        }
    }

    /// The variables to set for this allocator, and those to remove (a
    /// user's own `PYTORCH_CUDA_ALLOC_CONF` or `QUILT_ALLOC_CONF` never
    /// leaks into a run).
    pub fn environment(&self) -> (Vec<(&'static str, String)>, Vec<&'static str>) {
        let mut set = vec![("QUILT_LIVE_ALLOCATOR", self.hook_name().to_string())];
        let mut remove = vec![];
        match &self.kind {
            Kind::Classic => remove.extend(["PYTORCH_CUDA_ALLOC_CONF", "QUILT_ALLOC_CONF"]),
            Kind::Expandable => {
                set.push((
                    "PYTORCH_CUDA_ALLOC_CONF",
                    "expandable_segments:True".to_string(),
                ));
                remove.push("QUILT_ALLOC_CONF");
            }
            Kind::Quilt { conf } => {
                set.push(("QUILT_ALLOC_CONF", conf.clone()));
                remove.push("PYTORCH_CUDA_ALLOC_CONF");
            }
        }
        (set, remove)
    }

    /// The spec `ab` replays this allocator as (`quilt`'s settings are the
    /// same keys with `=`).
    pub fn replay_spec(&self) -> String {
        self.spec.clone()
    }
}

/// The allocators of a run, in report order: `--allocators` (by default
/// classic, expandable and quilt, unless `--allocator` is given), then each
/// `--allocator`; each parsed, none twice. The error names the bad spec.
pub fn allocators(list: Option<&[String]>, specs: &[String]) -> Result<Vec<LiveAllocator>, String> {
    let mut all: Vec<String> = match list {
        Some(list) => list.to_vec(),
        None if specs.is_empty() => DEFAULT_ALLOCATORS.iter().map(|s| s.to_string()).collect(),
        None => Vec::new(),
    };
    all.extend(specs.iter().cloned());
    if all.is_empty() {
        return Err("--allocators names none".into());
    }
    let mut out: Vec<LiveAllocator> = Vec::new();
    for spec in &all {
        let a = LiveAllocator::parse(spec).map_err(|e| format!("allocator `{spec}`: {e}"))?;
        if out.iter().any(|o| o.spec == a.spec) {
            return Err(format!("allocator `{spec}` is named twice"));
        }
        out.push(a);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;

    #[test]
    fn specs_parse_into_their_environment() {
        let q = LiveAllocator::parse("quilt:reclaim=always,page_size=4MiB").unwrap();
        assert_eq!(
            q.kind,
            Kind::Quilt {
                conf: "backend:cuda,reclaim:always,page_size:4MiB".into()
            }
        );
        let (set, remove) = q.environment();
        assert!(set.contains(&("QUILT_LIVE_ALLOCATOR", "quilt".into())));
        assert!(remove.contains(&"PYTORCH_CUDA_ALLOC_CONF"));
        let e = LiveAllocator::parse("expandable").unwrap();
        assert!(e
            .environment()
            .0
            .contains(&("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True".into())));
        assert_eq!(LiveAllocator::parse("classic").unwrap().kind, Kind::Classic);
    }

    #[test]
    fn bad_specs_say_why() {
        for (spec, says) in [
            ("gmlake", "unknown allocator"),
            ("quilt:reclaim=sometimes", "reclaim"),
            ("quilt:no_such_key=1", "no_such_key"),
            ("quilt:backend=host", "backend"),
            ("classic:max_split_size=1MiB", "takes no settings"),
            ("quilt:reclaim", "reclaim"),
        ] {
            let e = LiveAllocator::parse(spec).unwrap_err();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }

    #[test]
    fn the_default_list_and_repeats() {
        let all = allocators(None, &[]).unwrap();
        assert_eq!(all.len(), 3);
        let two = allocators(None, &["quilt:reclaim=always".into()]).unwrap();
        assert_eq!(two.len(), 1);
        assert!(allocators(Some(&["quilt".into()]), &["quilt".into()]).is_err());
    }
}
