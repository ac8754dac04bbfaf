//! The node journal in the simulation: the crate's [`MemoryJournal`], kept
//! across restarts of the runner (as the SQLite file would be), with write
//! failures armed per lease (a full or failing disk) and read failures armed
//! globally (start-up recovery cannot read it).

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;
use billet_agent::journal::{
    CustodyRecord, Durability, Journal, JournalError, LaunchRecord, MemoryJournal,
};

/// [`MemoryJournal`] with injected failures.
#[derive(Debug, Default)]
pub struct SimJournal {
    inner: MemoryJournal,
    /// Failures armed per lease id: how many writes touching it fail next.
    writes: Mutex<BTreeMap<String, u32>>,
    /// How many reads of the launch or custody tables fail next.
    reads: Mutex<u32>,
}

impl SimJournal {
    pub fn fail_writes(&self, lease: &str, times: u32) {
        *self
            .writes
            .lock()
            .unwrap()
            .entry(lease.to_owned())
            .or_default() += times;
    }

    pub fn fail_reads(&self, times: u32) {
        *self.reads.lock().unwrap() += times;
    }

    /// The leases the journal holds a launch or custody record for, read
    /// past any armed fault (for the world's checks, not the node).
    pub fn leases(&self) -> std::collections::BTreeSet<String> {
        use futures::FutureExt as _;
        let launches = self.inner.launches().now_or_never();
        let custody = self.inner.custody().now_or_never();
        let mut leases = std::collections::BTreeSet::new();
        if let Some(Ok(records)) = launches {
            leases.extend(records.into_iter().map(|r| r.lease));
        }
        if let Some(Ok(records)) = custody {
            leases.extend(records.into_iter().map(|r| r.lease));
        }
        leases
    }

    pub fn clear_faults(&self) {
        self.writes.lock().unwrap().clear();
        *self.reads.lock().unwrap() = 0;
    }

    fn write(&self, lease: &str) -> Result<(), JournalError> {
        let mut writes = self.writes.lock().unwrap();
        match writes.get_mut(lease) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Err(JournalError::Io("injected: disk I/O error".into()))
            }
            _ => Ok(()),
        }
    }

    fn read(&self) -> Result<(), JournalError> {
        let mut reads = self.reads.lock().unwrap();
        if *reads > 0 {
            *reads -= 1;
            return Err(JournalError::Io("injected: disk I/O error".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl Journal for SimJournal {
    async fn put_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        self.write(&launch.lease)?;
        self.inner.put_launch(launch).await
    }

    async fn amend_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        self.write(&launch.lease)?;
        self.inner.amend_launch(launch).await
    }

    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError> {
        self.write(lease)?;
        self.inner.forget_launch(lease).await
    }

    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError> {
        self.read()?;
        self.inner.launches().await
    }

    async fn put_custody(&self, entry: &CustodyRecord) -> Result<(), JournalError> {
        self.write(&entry.lease)?;
        self.inner.put_custody(entry).await
    }

    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError> {
        self.write(lease)?;
        self.inner.forget_custody(lease).await
    }

    async fn custody(&self) -> Result<Vec<CustodyRecord>, JournalError> {
        self.read()?;
        self.inner.custody().await
    }

    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: Durability,
    ) -> Result<(), JournalError> {
        self.inner.put_result(command, encoded, durability).await
    }

    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError> {
        self.inner.results().await
    }
}
