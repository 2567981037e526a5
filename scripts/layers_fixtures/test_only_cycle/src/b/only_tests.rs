#![cfg(test)]
//! Left out of every build but the tests' by its own inner attribute.

pub use crate::a::ANSWER;
