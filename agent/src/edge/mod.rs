//! The edge: where the outside world's shapes become the node's own.
//!
//! Owns: the node's own types for what travels on the wire ([`model`]: ids
//! as newtypes, phases, tiers, the JIT config as a credential), the
//! conversion from and to generated proto types with every field checked
//! ([`wire`]), and mTLS material ([`tls`]) and the
//! listener's accept loop with its limits ([`accept`]), the plane's clock
//! as this node reads it, for certificate dates ([`clock`]), the secondary
//! listeners' connection caps and accept backoff ([`listen`]), and the one call
//! the node dials, re-enrolment at the plane's endpoint ([`enroll`]).
//!
//! May not touch: lease state, the provider or the journal. Nothing past
//! this folder and [`crate::node::session`] sees a generated proto type.

pub mod accept;
pub mod clock;
pub mod enroll;
pub mod listen;
pub mod model;
pub mod tls;
pub mod wire;
