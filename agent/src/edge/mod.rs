//! The gRPC face: where the plane's session and the local socket meet the
//! node's core.
//!
//! Owns: the conversion from and to generated proto types with every field
//! checked ([`wire`]), the `Attach` service and its executor ([`session`]),
//! the single command slot ([`slot`]), the calls up the session ([`link`]:
//! the plane ports of [`crate::node::plane`] served over the session), the
//! local socket's service ([`local`]), the certificate's renewal and
//! re-enrolment ([`identity`]), and the wiring and serving of all of it
//! ([`server`]).
//!
//! May not touch: lease state except through [`crate::node::runner::Runner`],
//! the Docker engine except through [`crate::provider::Provider`]. Nothing
//! below this floor sees a generated proto type, but for
//! [`crate::local`]'s client of the local socket.

pub(crate) mod executor;
pub(crate) mod identity;
pub(crate) mod link;
pub(crate) mod local;
pub mod server;
pub mod session;
pub(crate) mod slot;
pub(crate) mod wire;
