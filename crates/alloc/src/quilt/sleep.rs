//! Tags, and putting a tag's memory to sleep and waking it.

use rustc_hash::FxHashMap as HashMap;

use super::state::{Kind, State};
use crate::error::AllocError;

/// Every tag seen, by dense index, with its state.
#[derive(Debug, Default)]
pub(crate) struct Tags {
    names: Vec<String>,
    index: HashMap<String, u32>,
    asleep: Vec<bool>,
}

impl Tags {
    /// The index of `name`, registering it on first sight.
    pub(crate) fn index(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(name.to_string());
        self.index.insert(name.to_string(), i);
        self.asleep.push(false);
        i
    }

    /// The name of tag `i`.
    pub(crate) fn name(&self, i: u32) -> &str {
        self.names.get(i as usize).map(String::as_str).unwrap_or("")
    }

    /// True when tag `i` is asleep.
    pub(crate) fn is_asleep(&self, i: u32) -> bool {
        self.asleep.get(i as usize).copied().unwrap_or(false)
    }

    /// An error unless tag `i` is awake.
    pub(crate) fn check_awake(&self, i: u32) -> Result<(), AllocError> {
        if self.is_asleep(i) {
            return Err(AllocError::TagState {
                tag: self.name(i).to_string(),
                reason: "the tag is asleep: wake it first",
            });
        }
        Ok(())
    }
}

impl State {
    /// An error when arena `ai` belongs to a sleeping tag.
    pub(crate) fn check_arena_awake(&self, ai: usize) -> Result<(), AllocError> {
        match self.arena_meta.get(ai) {
            Some(&(_, Kind::Tagged(t))) => self.tags.check_awake(t),
            _ => Ok(()),
        }
    }
}
