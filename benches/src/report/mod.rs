//! Bench reporting, one module per output: [`rows`], the measured data
//! structures (a row per workload and allocator, a point of a scaling run);
//! [`text`], the tables; [`json`], the JSON reports; [`charts`], the SVG
//! charts. The measuring is elsewhere ([`crate::ab`], [`crate::scale`]).

pub mod charts;
pub mod json;
pub mod rows;
pub mod text;
