//! y: q is used by x's p; r uses x's s.

pub mod q;
pub mod r;
