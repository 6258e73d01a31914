//! Runs that span processes (CPU): the data plane's frame codec and the
//! messages it carries.

pub mod frame;
pub mod wire;
