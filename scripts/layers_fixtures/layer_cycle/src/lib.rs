//! The base crate and two more layers whose parts use each other.

pub mod a;
pub mod app;
pub mod b;
pub mod http;
pub mod x;
pub mod y;
