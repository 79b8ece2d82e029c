//! Allocation traces: the text format of `shared/traces/README.md`.
//!
//! ```text
//! a <id> <size_bytes> <stream>    allocation; ids are never reused
//! f <id>                          free of a live id
//! ```

use std::collections::HashSet;
use std::path::Path;

/// One trace event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Allocate `size` bytes on `stream` under the name `id`.
    Alloc {
        /// Identifier, unique over the trace.
        id: u64,
        /// Bytes asked for (unrounded).
        size: u64,
        /// Stream number (0 = default stream).
        stream: u64,
    },
    /// Free the live allocation `id`.
    Free {
        /// Identifier of a live allocation.
        id: u64,
    },
}

/// A named sequence of events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// Name shown in reports (a file stem or a generator name).
    pub name: String,
    /// The events, in order.
    pub events: Vec<Event>,
    /// How many leading events are allocations that were live before the
    /// recorded window (weights, inputs): kept outside an iteration loop.
    pub preexisting: usize,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line is malformed or inconsistent.
    #[error("line {line}: {message}: `{text}`")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
        /// The offending line (cut to 80 characters).
        text: String,
    },
    /// A snapshot pickle is malformed.
    #[error("snapshot: {0}")]
    Snapshot(String),
}

/// Parse the text format. Blank lines are skipped; every other malformed line,
/// a reused id, a free of an id that is not live, or a zero size is an error
/// naming the line.
pub fn parse_trace(text: &str) -> Result<Vec<Event>, TraceError> {
    let mut events = Vec::new();
    let mut live = HashSet::new();
    let mut seen = HashSet::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let fail = |message: String| TraceError::Parse {
            line: index + 1,
            message,
            text: line.chars().take(80).collect(),
        };
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let number = |i: usize, what: &str| -> Result<u64, TraceError> {
            let field = fields
                .get(i)
                .ok_or_else(|| fail(format!("missing {what}")))?;
            field
                .parse::<u64>()
                .map_err(|e| fail(format!("bad {what} `{field}`: {e}")))
        };
        match fields.first().copied() {
            Some("a") => {
                if fields.len() != 4 {
                    return Err(fail(format!(
                        "an allocation has 4 fields, found {}",
                        fields.len()
                    )));
                }
                let id = number(1, "id")?;
                let size = number(2, "size")?;
                let stream = number(3, "stream")?;
                if size == 0 {
                    return Err(fail("allocation of 0 bytes".into()));
                }
                if !seen.insert(id) {
                    return Err(fail(format!("id {id} allocated twice")));
                }
                live.insert(id);
                events.push(Event::Alloc { id, size, stream });
            }
            Some("f") => {
                if fields.len() != 2 {
                    return Err(fail(format!("a free has 2 fields, found {}", fields.len())));
                }
                let id = number(1, "id")?;
                if !live.remove(&id) {
                    return Err(fail(format!("free of id {id}, which is not live")));
                }
                events.push(Event::Free { id });
            }
            Some(other) => return Err(fail(format!("unknown event kind `{other}`"))),
            None => {}
        }
    }
    Ok(events)
}

/// Read and parse a trace file; its name is the file stem. `preexisting` is 0:
/// callers that know the prefix (from `stats.json`) set it.
pub fn load_trace(path: &Path) -> Result<Trace, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let events = parse_trace(&text)?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    Ok(Trace {
        name,
        events,
        preexisting: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_allocs_and_frees() {
        let events = parse_trace("a 0 100 0\na 1 5 2\n\nf 0\n").unwrap();
        assert_eq!(
            events,
            vec![
                Event::Alloc {
                    id: 0,
                    size: 100,
                    stream: 0
                },
                Event::Alloc {
                    id: 1,
                    size: 5,
                    stream: 2
                },
                Event::Free { id: 0 },
            ]
        );
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("a 0 100 0\nf 1\n", 2, "not live"),
            ("a 0 100\n", 1, "4 fields"),
            ("a 0 x 0\n", 1, "bad size"),
            ("a 0 0 0\n", 1, "0 bytes"),
            ("a 0 1 0\na 0 1 0\n", 2, "twice"),
            ("a 0 1 0\nf 0\nf 0\n", 3, "not live"),
            ("x 1\n", 1, "unknown event"),
            ("a 0 99999999999999999999999 0\n", 1, "bad size"),
        ];
        for (text, want_line, want_msg) in cases {
            match parse_trace(text) {
                Err(TraceError::Parse { line, message, .. }) => {
                    assert_eq!(line, want_line, "{text:?}");
                    assert!(message.contains(want_msg), "{text:?}: {message}");
                }
                other => panic!("{text:?}: expected a parse error, got {other:?}"),
            }
        }
    }
}
