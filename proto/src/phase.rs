//! [`Phase`](crate::phase::Phase), where a lease is in its life, and the table of legal moves
//! between phases (the reference ledger's edges, `spec/ledger-and-github.md`
//! §1.4).
//!
//! Pure: no storage, no clock. The phase's lowercase name is what travels in
//! `Lease.phase` and what the ledger stores, and its edges are what both
//! ends judge a move by: the plane's ledger refuses any edge this table does
//! not list, and the node checks the moves it asks for against the same
//! table. One copy, here beside the wire it spells, so the node and the
//! plane cannot drift apart.

use std::fmt;

/// A lease phase. Travels on the wire as its lowercase name ([`Phase::as_str`]).
///
/// The edges are the reference ledger's (`spec/ledger-and-github.md` §1.4):
/// `capacity → assigned → launching → online → busy`; any phase from
/// launching on may go to custody, teardown or quarantine; custody to
/// teardown or quarantine; teardown to quarantine; every live phase to the
/// terminals `done` and `failed`, which release capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Escrowed and advertised, with no job yet.
    Capacity,
    /// GitHub gave this lease a job.
    Assigned,
    /// A node is bringing the instance up.
    Launching,
    /// The runner has registered.
    Online,
    /// The runner is executing the job.
    Busy,
    /// A node keeps compute alive that it can no longer manage as an
    /// ordinary command.
    Custody,
    /// Destruction was requested but not yet confirmed.
    Teardown,
    /// The holder stopped heartbeating while compute might still exist.
    Quarantine,
    /// Terminal: finished.
    Done,
    /// Terminal: failed or reclaimed.
    Failed,
}

impl Phase {
    /// Every phase, in lifecycle order.
    pub const ALL: [Phase; 10] = [
        Phase::Capacity,
        Phase::Assigned,
        Phase::Launching,
        Phase::Online,
        Phase::Busy,
        Phase::Custody,
        Phase::Teardown,
        Phase::Quarantine,
        Phase::Done,
        Phase::Failed,
    ];

    /// The lowercase wire and storage spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Capacity => "capacity",
            Phase::Assigned => "assigned",
            Phase::Launching => "launching",
            Phase::Online => "online",
            Phase::Busy => "busy",
            Phase::Custody => "custody",
            Phase::Teardown => "teardown",
            Phase::Quarantine => "quarantine",
            Phase::Done => "done",
            Phase::Failed => "failed",
        }
    }

    /// The phase spelled `s` exactly (lowercase, no spaces), or `None`.
    pub fn parse(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// Whether `self → to` is a legal edge. Staying in the same phase is not
    /// an edge; callers treat it as an idempotent repeat.
    pub fn can_move_to(self, to: Phase) -> bool {
        use Phase::{
            Assigned, Busy, Capacity, Custody, Done, Failed, Launching, Online, Quarantine,
            Teardown,
        };
        match self {
            Capacity => matches!(to, Assigned | Done | Failed),
            Assigned => matches!(to, Launching | Done | Failed),
            Launching => matches!(to, Online | Custody | Teardown | Quarantine | Done | Failed),
            Online => matches!(to, Busy | Custody | Teardown | Quarantine | Done | Failed),
            Busy => matches!(to, Custody | Teardown | Quarantine | Done | Failed),
            Custody => matches!(to, Teardown | Quarantine | Done | Failed),
            Teardown => matches!(to, Quarantine | Done | Failed),
            Quarantine => matches!(to, Done | Failed),
            Done | Failed => false,
        }
    }

    /// `done` or `failed`: the lease no longer charges capacity.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Done | Phase::Failed)
    }

    /// Whether compute may exist behind a lease in this phase, as the reaper
    /// judges it: launching, online, busy, custody, teardown.
    pub fn may_have_compute(self) -> bool {
        matches!(
            self,
            Phase::Launching | Phase::Online | Phase::Busy | Phase::Custody | Phase::Teardown
        )
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_phase_pair_follows_the_transition_table() {
        use Phase::*;
        // Rows: from; columns: to, in `Phase::ALL` order
        // (capacity assigned launching online busy custody teardown quarantine done failed).
        let table: [(Phase, &str); 10] = [
            (Capacity, ".x......xx"),
            (Assigned, "..x.....xx"),
            (Launching, "...x.xxxxx"),
            (Online, "....xxxxxx"),
            (Busy, ".....xxxxx"),
            (Custody, "......xxxx"),
            (Teardown, ".......xxx"),
            (Quarantine, "........xx"),
            (Done, ".........."),
            (Failed, ".........."),
        ];
        for (from, row) in table {
            for (to, mark) in Phase::ALL.into_iter().zip(row.chars()) {
                assert_eq!(from.can_move_to(to), mark == 'x', "{from} -> {to}");
            }
        }
        assert_eq!(table.map(|(p, _)| p), Phase::ALL);
    }

    #[test]
    fn every_phase_round_trips_through_its_lowercase_wire_spelling() {
        for phase in Phase::ALL {
            assert_eq!(Phase::parse(phase.as_str()), Some(phase));
            assert_eq!(phase.to_string(), phase.as_str());
            assert_eq!(phase.as_str(), phase.as_str().to_lowercase());
        }
        assert_eq!(Phase::parse("Online"), None);
        assert_eq!(Phase::parse(""), None);
        assert_eq!(Phase::parse("running"), None);
    }

    #[test]
    fn only_launching_through_teardown_may_have_compute() {
        let with_compute: Vec<Phase> = Phase::ALL
            .into_iter()
            .filter(|p| p.may_have_compute())
            .collect();
        use Phase::*;
        assert_eq!(with_compute, [Launching, Online, Busy, Custody, Teardown]);
    }
}
