//! Allocation traces: the text format of `shared/traces/README.md`, and the
//! serving events of `docs/workloads.md` ("Serving events").
//!
//! ```text
//! a <id> <size_bytes> <stream>         allocation; ids are never reused
//! f <id>                               free of a live allocation
//! c <id> <max_bytes> <stream>          create a growable buffer: length 0, at most max_bytes
//! g <id> <bytes>                       grow buffer id to bytes (at least its length, at most its max)
//! s <id> <bytes>                       shrink buffer id to bytes (at most its length)
//! r <id>                               release buffer id
//! t <id> <size_bytes> <stream> <tag>   allocation carrying tag (a number); freed with `f`
//! z <tag>                              sleep: the tag's allocations leave the device
//! w <tag>                              wake: they come back (at the same addresses on Quilt)
//! u <id> <stream>                      allocation id is also used on stream (record_stream)
//! ```
//!
//! Allocations and growable buffers share one space of ids.

use std::collections::{HashMap, HashSet};
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
    /// Create a growable buffer of at most `max` bytes, length 0, whose
    /// growth is ordered on `stream` (`c`).
    CreateGrowable {
        /// Identifier, unique over the trace.
        id: u64,
        /// Its maximum length in bytes (> 0).
        max: u64,
        /// Stream number.
        stream: u64,
    },
    /// Grow the live growable buffer `id` to `bytes` (`g`): at least its
    /// length (equal: nothing to do), at most its maximum.
    Grow {
        /// Identifier of a live growable buffer.
        id: u64,
        /// Its new length.
        bytes: u64,
    },
    /// Shrink the live growable buffer `id` to `bytes` (`s`): at most its length.
    Shrink {
        /// Identifier of a live growable buffer.
        id: u64,
        /// Its new length.
        bytes: u64,
    },
    /// Release the live growable buffer `id` (`r`).
    ReleaseGrowable {
        /// Identifier of a live growable buffer.
        id: u64,
    },
    /// Allocate `size` bytes on `stream` carrying `tag` (`t`): the allocation
    /// sleeps and wakes with the tag; it is freed with [`Event::Free`].
    AllocTagged {
        /// Identifier, unique over the trace.
        id: u64,
        /// Bytes asked for (unrounded).
        size: u64,
        /// Stream number.
        stream: u64,
        /// The tag (a number; Quilt's tag is its decimal text).
        tag: u64,
    },
    /// Put `tag` to sleep (`z`): its allocations' contents go to the host and
    /// their memory is given back, until [`Event::Wake`].
    Sleep {
        /// An awake tag that an allocation carried.
        tag: u64,
    },
    /// Wake `tag` (`w`): its allocations are backed again and their contents
    /// copied back.
    Wake {
        /// A sleeping tag.
        tag: u64,
    },
    /// The live allocation `id` is also used on `stream` (`u`): PyTorch's
    /// `record_stream`, so that its memory is not reused before the work
    /// queued on `stream` before its free has completed.
    RecordStream {
        /// Identifier of a live allocation.
        id: u64,
        /// Stream number.
        stream: u64,
    },
}

impl Event {
    /// True for the events of the serving API (growable buffers, tags, sleep
    /// and wake), which only Quilt executes natively.
    pub fn is_serving(&self) -> bool {
        !matches!(
            self,
            Event::Alloc { .. } | Event::Free { .. } | Event::RecordStream { .. }
        )
    }
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

/// What the parser knows of the ids and tags so far.
#[derive(Default)]
struct Known {
    /// Ids ever used.
    seen: HashSet<u64>,
    /// Live allocations and their tags.
    live: HashMap<u64, Option<u64>>,
    /// Live growable buffers: (length, maximum).
    growables: HashMap<u64, (u64, u64)>,
    /// Tags ever carried, and whether each sleeps.
    asleep: HashMap<u64, bool>,
}

impl Known {
    fn new_id(&mut self, id: u64) -> Result<(), String> {
        if self.seen.insert(id) {
            Ok(())
        } else {
            Err(format!("id {id} used twice"))
        }
    }

    fn growable(&mut self, id: u64, what: &str) -> Result<&mut (u64, u64), String> {
        self.growables
            .get_mut(&id)
            .ok_or_else(|| format!("{what} of id {id}, which is not a live growable buffer"))
    }

    /// The event a line describes, checked against what came before.
    fn event(&mut self, fields: &[&str]) -> Result<Event, String> {
        let number = |i: usize, what: &str| -> Result<u64, String> {
            let field = fields.get(i).ok_or_else(|| format!("missing {what}"))?;
            field
                .parse::<u64>()
                .map_err(|e| format!("bad {what} `{field}`: {e}"))
        };
        let arity = |n: usize, what: &str| -> Result<(), String> {
            if fields.len() == n {
                Ok(())
            } else {
                Err(format!("{what} has {n} fields, found {}", fields.len()))
            }
        };
        let kind = fields.first().copied().unwrap_or_default();
        Ok(match kind {
            "a" | "t" => {
                let tagged = kind == "t";
                if tagged {
                    arity(5, "a tagged allocation")?;
                } else {
                    arity(4, "an allocation")?;
                }
                let id = number(1, "id")?;
                let size = number(2, "size")?;
                let stream = number(3, "stream")?;
                if size == 0 {
                    return Err("allocation of 0 bytes".into());
                }
                let tag = if tagged {
                    Some(number(4, "tag")?)
                } else {
                    None
                };
                if let Some(tag) = tag {
                    if self.asleep.get(&tag) == Some(&true) {
                        return Err(format!("allocation carrying tag {tag}, which sleeps"));
                    }
                }
                if !self.seen.insert(id) {
                    return Err(format!("id {id} allocated twice"));
                }
                self.live.insert(id, tag);
                match tag {
                    Some(tag) => {
                        self.asleep.insert(tag, false);
                        Event::AllocTagged {
                            id,
                            size,
                            stream,
                            tag,
                        }
                    }
                    None => Event::Alloc { id, size, stream },
                }
            }
            "f" => {
                arity(2, "a free")?;
                let id = number(1, "id")?;
                match self.live.get(&id) {
                    None => return Err(format!("free of id {id}, which is not live")),
                    Some(Some(tag)) if self.asleep.get(tag) == Some(&true) => {
                        return Err(format!("free of id {id}, whose tag {tag} sleeps"));
                    }
                    Some(_) => {}
                }
                self.live.remove(&id);
                Event::Free { id }
            }
            "c" => {
                arity(4, "a growable creation")?;
                let id = number(1, "id")?;
                let max = number(2, "maximum")?;
                let stream = number(3, "stream")?;
                if max == 0 {
                    return Err("growable buffer of at most 0 bytes".into());
                }
                self.new_id(id)?;
                self.growables.insert(id, (0, max));
                Event::CreateGrowable { id, max, stream }
            }
            "g" | "s" => {
                let grow = kind == "g";
                arity(3, if grow { "a grow" } else { "a shrink" })?;
                let id = number(1, "id")?;
                let bytes = number(2, "length")?;
                let (len, max) = self.growable(id, if grow { "grow" } else { "shrink" })?;
                if grow && bytes > *max {
                    return Err(format!(
                        "grow of id {id} to {bytes} bytes, beyond its maximum of {max}"
                    ));
                }
                if grow && bytes < *len {
                    return Err(format!(
                        "grow of id {id} to {bytes} bytes, below its length of {len}"
                    ));
                }
                if !grow && bytes > *len {
                    return Err(format!(
                        "shrink of id {id} to {bytes} bytes, above its length of {len}"
                    ));
                }
                *len = bytes;
                if grow {
                    Event::Grow { id, bytes }
                } else {
                    Event::Shrink { id, bytes }
                }
            }
            "r" => {
                arity(2, "a release")?;
                let id = number(1, "id")?;
                self.growable(id, "release")?;
                self.growables.remove(&id);
                Event::ReleaseGrowable { id }
            }
            "z" | "w" => {
                let sleep = kind == "z";
                arity(2, if sleep { "a sleep" } else { "a wake" })?;
                let tag = number(1, "tag")?;
                let Some(asleep) = self.asleep.get_mut(&tag) else {
                    return Err(format!("tag {tag}, which no allocation carried"));
                };
                if *asleep == sleep {
                    return Err(format!(
                        "{} of tag {tag}, which {}",
                        if sleep { "sleep" } else { "wake" },
                        if sleep { "sleeps already" } else { "is awake" }
                    ));
                }
                *asleep = sleep;
                if sleep {
                    Event::Sleep { tag }
                } else {
                    Event::Wake { tag }
                }
            }
            "u" => {
                arity(3, "a stream use")?;
                let id = number(1, "id")?;
                let stream = number(2, "stream")?;
                match self.live.get(&id) {
                    None => return Err(format!("stream use of id {id}, which is not live")),
                    Some(Some(tag)) if self.asleep.get(tag) == Some(&true) => {
                        return Err(format!("stream use of id {id}, whose tag {tag} sleeps"));
                    }
                    Some(_) => {}
                }
                Event::RecordStream { id, stream }
            }
            other => return Err(format!("unknown event kind `{other}`")),
        })
    }
}

/// Parse the text format. Blank lines are skipped; every other malformed line,
/// a reused id, a free of an id that is not live, a zero size or maximum, a
/// resize of an id that is not a live growable buffer or past its bounds, an
/// allocation carrying or a free of a member of a sleeping tag, a stream use
/// of an id that is not a live allocation or whose tag sleeps, a sleep of a
/// sleeping or unknown tag and a wake of an awake one are errors naming the line.
pub fn parse_trace(text: &str) -> Result<Vec<Event>, TraceError> {
    let mut events = Vec::new();
    let mut known = Known::default();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let event = known.event(&fields).map_err(|message| TraceError::Parse {
            line: index + 1,
            message,
            text: line.chars().take(80).collect(),
        })?;
        events.push(event);
    }
    Ok(events)
}

/// The text of `events` in the format [`parse_trace`] reads, a line each.
pub fn to_text(events: &[Event]) -> String {
    let mut out = String::new();
    for e in events {
        let line = match *e {
            Event::Alloc { id, size, stream } => format!("a {id} {size} {stream}"),
            Event::Free { id } => format!("f {id}"),
            Event::CreateGrowable { id, max, stream } => format!("c {id} {max} {stream}"),
            Event::Grow { id, bytes } => format!("g {id} {bytes}"),
            Event::Shrink { id, bytes } => format!("s {id} {bytes}"),
            Event::ReleaseGrowable { id } => format!("r {id}"),
            Event::AllocTagged {
                id,
                size,
                stream,
                tag,
            } => format!("t {id} {size} {stream} {tag}"),
            Event::Sleep { tag } => format!("z {tag}"),
            Event::Wake { tag } => format!("w {tag}"),
            Event::RecordStream { id, stream } => format!("u {id} {stream}"),
        };
        out.push_str(&line);
        out.push('\n');
    }
    out
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
            ("g 3 10\n", 1, "not a live growable"),
            ("c 0 100 0\ng 0 101\n", 2, "beyond its maximum"),
            ("c 0 100 0\ng 0 50\ng 0 40\n", 3, "below its length"),
            ("c 0 100 0\ng 0 50\ns 0 60\n", 3, "above its length"),
            ("c 0 100 0\nr 0\nr 0\n", 3, "not a live growable"),
            ("c 0 0 0\n", 1, "0 bytes"),
            ("a 0 1 0\nc 0 5 0\n", 2, "twice"),
            ("c 0 5 0\nf 0\n", 2, "not live"),
            ("a 0 1 0\nr 0\n", 2, "not a live growable"),
            ("z 4\n", 1, "no allocation carried"),
            ("t 0 10 0 4\nz 4\nz 4\n", 3, "sleeps already"),
            ("t 0 10 0 4\nw 4\n", 2, "is awake"),
            ("t 0 10 0 4\nz 4\nf 0\n", 3, "sleeps"),
            ("t 0 10 0 4\nz 4\nt 1 10 0 4\n", 3, "sleeps"),
            ("t 0 10 0\n", 1, "5 fields"),
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
