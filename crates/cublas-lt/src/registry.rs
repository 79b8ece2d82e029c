//! Live objects behind the opaque pointers the face hands out (handles,
//! descriptors, layouts, preferences): each pointer is a heap cell of the
//! face's own, unique while the object lives, and the object's state is
//! kept in a table under that address. A pointer the table does not hold
//! (null, destroyed, never made, or of another kind) is refused, where
//! cuBLAS would read freed memory.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, PoisonError};

/// Live objects of one kind.
pub struct Registry<T> {
    live: Mutex<Option<HashMap<usize, T>>>,
}

impl<T> Registry<T> {
    /// An empty registry (a `static`).
    pub const fn new() -> Self {
        Registry {
            live: Mutex::new(None),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut HashMap<usize, T>) -> R) -> R {
        let mut guard = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        f(guard.get_or_insert_with(HashMap::new))
    }

    /// Makes an object and returns its pointer.
    pub fn insert(&self, value: T) -> *mut c_void {
        let cell = Box::into_raw(Box::new(0u64)).cast::<c_void>();
        self.with(|m| m.insert(cell as usize, value));
        cell
    }

    /// Destroys the object at `p`; `None` where none lives there.
    pub fn remove(&self, p: *const c_void) -> Option<T> {
        let value = self.with(|m| m.remove(&(p as usize)))?;
        // SAFETY: the object was live, so `insert` made `p` with
        // Box::into_raw, and removing it from the table makes this the only
        // release.
        drop(unsafe { Box::from_raw(p.cast_mut().cast::<u64>()) });
        Some(value)
    }

    /// `f` on the object at `p`; `None` where none lives there.
    pub fn get<R>(&self, p: *const c_void, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        self.with(|m| m.get_mut(&(p as usize)).map(f))
    }
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self::new()
    }
}
