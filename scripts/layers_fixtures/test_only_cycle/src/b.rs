//! b: uses a, but only in code built for tests.

#[cfg(test)]
use crate::a::answer;

#[cfg(test)]
mod support;

mod only_tests;

pub fn helper() -> u32 {
    1
}

#[cfg(all(test, unix))]
pub const UNIX_ANSWER: u32 = crate::a::ANSWER;

pub struct Holder {
    pub n: u32,
    #[cfg(test)]
    pub from_a: crate::a::Answer,
}

impl Holder {
    #[cfg(test)]
    pub fn from_a() -> Self {
        Holder { n: super::a::ANSWER, from_a: crate::a::Answer(1) }
    }
}

pub fn pick(n: u32) -> u32 {
    match n {
        #[cfg(test)]
        0 => crate::a::ANSWER,
        _ => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::a;

    #[test]
    fn answers() {
        assert_eq!(a::answer(), helper() + 41);
        assert_eq!(answer(), 42);
    }
}
