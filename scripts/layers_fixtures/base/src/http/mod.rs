//! http: handlers take app's state (the one cycle allowed).

use crate::app::AppState;

mod inner {
    pub fn base() -> u32 {
        crate::b::helper()
    }
}

pub fn serve(state: &AppState) -> u32 {
    state.name.len() as u32 + inner::base()
}
