//! The journal in memory, for tests and the simulation.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use super::*;

/// A journal in memory: the seam's fake, and what a runner without a state
/// directory uses. Survives a runner being rebuilt over
/// it, which is how tests model a restart.
#[derive(Debug, Default)]
pub struct MemoryJournal {
    launches: Mutex<BTreeMap<String, LaunchRecord>>,
    custody: Mutex<BTreeMap<String, CustodyRecord>>,
    results: Mutex<Vec<(String, Vec<u8>)>>,
    result_durability: Mutex<BTreeMap<String, Durability>>,
    mounts: Mutex<BTreeMap<String, MountRecord>>,
    sessions: Mutex<BTreeMap<String, SessionRecord>>,
    actions_sessions: Mutex<BTreeMap<String, String>>,
}

impl MemoryJournal {
    /// The durability `command`'s result was last written at, if it was.
    #[cfg(test)]
    pub(crate) fn result_durability(&self, command: &str) -> Option<Durability> {
        self.result_durability
            .lock()
            .expect("journal")
            .get(command)
            .copied()
    }
}

#[async_trait]
impl MountJournal for MemoryJournal {
    async fn put_mount(&self, mount: &MountRecord) -> Result<(), JournalError> {
        self.mounts
            .lock()
            .expect("journal")
            .insert(mount.mount.clone(), mount.clone());
        Ok(())
    }
    async fn forget_mount(&self, mount: &str) -> Result<(), JournalError> {
        self.mounts.lock().expect("journal").remove(mount);
        Ok(())
    }
    async fn mounts(&self) -> Result<Vec<MountRecord>, JournalError> {
        Ok(self
            .mounts
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_session(&self, session: &SessionRecord) -> Result<(), JournalError> {
        self.sessions
            .lock()
            .expect("journal")
            .insert(session.lease.clone(), session.clone());
        Ok(())
    }
    async fn forget_session(&self, lease: &str) -> Result<(), JournalError> {
        self.sessions.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn sessions(&self) -> Result<Vec<SessionRecord>, JournalError> {
        Ok(self
            .sessions
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_actions_session(&self, lease: &str, record: &str) -> Result<(), JournalError> {
        self.actions_sessions
            .lock()
            .expect("journal")
            .insert(lease.to_owned(), record.to_owned());
        Ok(())
    }
    async fn forget_actions_session(&self, lease: &str) -> Result<(), JournalError> {
        self.actions_sessions.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn actions_sessions(&self) -> Result<Vec<(String, String)>, JournalError> {
        Ok(self
            .actions_sessions
            .lock()
            .expect("journal")
            .iter()
            .map(|(l, r)| (l.clone(), r.clone()))
            .collect())
    }
}

#[async_trait]
impl Journal for MemoryJournal {
    async fn put_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        self.launches
            .lock()
            .expect("journal")
            .insert(launch.lease.clone(), launch.clone());
        Ok(())
    }
    async fn amend_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        if let Some(l) = self
            .launches
            .lock()
            .expect("journal")
            .get_mut(&launch.lease)
        {
            *l = launch.clone();
        }
        Ok(())
    }
    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError> {
        self.launches.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError> {
        Ok(self
            .launches
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_custody(&self, entry: &CustodyRecord) -> Result<(), JournalError> {
        self.custody
            .lock()
            .expect("journal")
            .insert(entry.lease.clone(), entry.clone());
        Ok(())
    }
    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError> {
        self.custody.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn custody(&self) -> Result<Vec<CustodyRecord>, JournalError> {
        Ok(self
            .custody
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: Durability,
    ) -> Result<(), JournalError> {
        self.result_durability
            .lock()
            .expect("journal")
            .insert(command.to_owned(), durability);
        let mut results = self.results.lock().expect("journal");
        results.retain(|(c, _)| c != command);
        results.push((command.to_owned(), encoded.to_vec()));
        let excess = results.len().saturating_sub(RESULTS_KEPT as usize);
        results.drain(..excess);
        Ok(())
    }
    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError> {
        Ok(self.results.lock().expect("journal").clone())
    }
}
