//! app: owns the state and serves it with http (the one cycle allowed).

pub struct AppState {
    pub name: &'static str,
}

pub fn run() -> u32 {
    crate::http::serve(&AppState { name: "fixture" })
}
