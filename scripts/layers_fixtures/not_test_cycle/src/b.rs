//! b: uses a in code built when not testing: a cycle.

#[cfg(not(test))]
pub use crate::a::ANSWER;

pub fn helper() -> u32 {
    1
}
