//! x: p uses y's q, and y's r uses x's s.

pub mod p;
pub mod s;
