//! # quilt-pool: the page-granularity physical pool (being written)
#![forbid(unsafe_code)]
