//! Host backend (being written).
