//! a: uses b.

use crate::b::helper;

pub const ANSWER: u32 = 42;

pub struct Answer(pub u32);

pub fn answer() -> u32 {
    helper() + 41
}
