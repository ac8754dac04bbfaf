//! The node's core: turns each assigned lease into running compute and
//! cleans up exactly what it started.
//!
//! Owns: lease state on this host ([`runner`] for the ordinary lifecycle,
//! [`custody`] for compute held on the node's own authority, [`ending`] for
//! why compute ended and how its registration is removed), the plane
//! session and its single command slot ([`session`], [`slot`]), the calls up
//! the session ([`plane`]), the node's memory across restarts ([`journal`]),
//! the local socket for the updater ([`local`]), its metrics ([`metrics`]),
//! its certificate's renewal and re-enrolment ([`identity`]), spot
//! interruption notices ([`interruption`]), and the wiring and serving
//! of all of it ([`server`]).
//!
//! May not touch: generated proto types past [`session`] (conversion is
//! [`crate::edge::wire`]'s), the Docker engine except through
//! [`crate::provider::Provider`], SQLite except in [`journal`], and the
//! installed binary (that is [`crate::upgrade`]'s).

pub mod custody;
pub mod ending;
pub mod health;
pub mod identity;
pub mod interruption;
pub mod journal;
pub mod local;
pub mod metrics;
pub mod plane;
pub mod runner;
pub mod server;
pub mod session;
pub mod slot;
