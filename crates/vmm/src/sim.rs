//! Simulated backend (being written).
