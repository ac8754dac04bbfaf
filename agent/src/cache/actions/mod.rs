//! The transparent GitHub Actions cache (spec/cache.md §1.3, §2.5, §5.2):
//! on a trusted tier that opts in, the node is an authenticated CONNECT
//! proxy for the results service, answers the three `CacheService` Twirp
//! methods from archives on its own disk, and splices everything else to
//! GitHub unchanged.
//!
//! - this file: the vocabulary. [`CacheScope`] (the tier's static scope,
//!   checked as the reference's `validateActionsScope`), [`ActionsPolicy`]
//!   (the plane's kill switch, asked before every locally handled
//!   operation; `DenyAll` until the plane answers it, [`FakePolicy`] for
//!   tests), [`ActionsError`].
//!
//! Invariant: a denial or an unanswered policy question before a
//! reservation exists sends the request to GitHub (fail-open to GitHub,
//! never to local storage).

pub mod archives;
pub mod ca;
pub mod proxy;
pub(crate) mod staging;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;

/// The variable that holds the guest's proxy URL,
/// `http://billet:<token>@<address>`: a credential, passed apart from the
/// plain environment like `BILLET_CACHE_TOKEN`.
pub(crate) const PROXY_ENV: &str = "BILLET_ACTIONS_PROXY";
/// The variable that names the interception CA's PEM file in the guest.
pub(crate) const CA_FILE_ENV: &str = "BILLET_ACTIONS_CA_FILE";
/// The CA's file name in the session's directory
/// (`/run/billet-cache/actions-ca.pem` in the guest).
pub(crate) const CA_FILE: &str = "actions-ca.pem";

/// The results service's host, the only authority the proxy tunnels to.
pub const RESULTS_HOST: &str = "results-receiver.actions.githubusercontent.com";

/// How long the policy may take to answer before the operation is treated
/// as denied (spec/cache.md §5.2: 2 s).
pub(crate) const POLICY_TIMEOUT: Duration = Duration::from_secs(2);

pub use crate::model::scope::{ActionsError, CacheScope, MAX_NAME_BYTES, MAX_WORKFLOW_REF_BYTES};

/// Why the policy gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PolicyError {
    /// The plane could not be asked or could not answer (its policy store
    /// is down, the session is gone).
    #[error("the Actions cache policy is unavailable: {0}")]
    Unavailable(String),
    /// No answer within [`POLICY_TIMEOUT`].
    #[error("the Actions cache policy did not answer within {POLICY_TIMEOUT:?}")]
    Timeout,
}

/// The kill switch (spec/cache.md §5.2, the reference's
/// `ActionsCacheAllowed`): may `owner/repository`'s jobs use this node's
/// Actions cache? Asked with the session's static scope (the caller's
/// repository, even when the workflow is a reusable one of another
/// repository) before every locally handled operation, through [`ask`]
/// (which bounds it to [`POLICY_TIMEOUT`]).
///
/// Denied or unanswered before a reservation exists: the request goes to
/// GitHub. After a signed upload URL was issued: that reservation's blob
/// calls and finalize get a local 502. A finalize with a completed receipt
/// is answered regardless.
#[async_trait::async_trait]
pub trait ActionsPolicy: Send + Sync + std::fmt::Debug {
    /// `Ok(true)`: allowed; `Ok(false)`: an operator blocked the owner or
    /// the repository.
    ///
    /// # Errors
    ///
    /// [`PolicyError`] when there is no answer; the caller treats it as a
    /// denial.
    async fn allowed(&self, owner: &str, repository: &str) -> Result<bool, PolicyError>;
}

/// Asks `policy` about `scope`, bounded to [`POLICY_TIMEOUT`].
///
/// # Errors
///
/// [`PolicyError::Timeout`] after [`POLICY_TIMEOUT`], or the policy's own
/// error.
pub(crate) async fn ask(
    policy: &dyn ActionsPolicy,
    scope: &CacheScope,
) -> Result<bool, PolicyError> {
    tokio::time::timeout(
        POLICY_TIMEOUT,
        policy.allowed(scope.owner(), scope.repository()),
    )
    .await
    .unwrap_or(Err(PolicyError::Timeout))
}

/// The policy a node has until the plane answers the question (NodeCall
/// 26): every operation denied, so every request goes to GitHub.
#[derive(Debug, Default, Clone, Copy)]
#[cfg(test)]
pub(crate) struct DenyAll;

#[cfg(test)]
#[async_trait::async_trait]
impl ActionsPolicy for DenyAll {
    async fn allowed(&self, _owner: &str, _repository: &str) -> Result<bool, PolicyError> {
        Ok(false)
    }
}

/// What a [`FakePolicy`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeAnswer {
    /// `Ok(true)`.
    Allow,
    /// `Ok(false)`.
    Deny,
    /// `Err(PolicyError::Unavailable)`.
    Fail,
    /// Never answers (the caller's timeout ends it).
    Hang,
}

/// A scripted policy for tests: answers what it was told and records
/// every question (`(owner, repository)`).
#[derive(Debug, Clone)]
pub struct FakePolicy {
    answer: Arc<Mutex<FakeAnswer>>,
    asked: Arc<Mutex<Vec<(String, String)>>>,
}

impl FakePolicy {
    /// A policy answering `answer` until `FakePolicy::set`.
    #[must_use]
    pub fn new(answer: FakeAnswer) -> Self {
        Self {
            answer: Arc::new(Mutex::new(answer)),
            asked: Arc::default(),
        }
    }

    /// Answers `answer` from now on (an operator flipping the switch).
    #[cfg(test)]
    pub(crate) fn set(&self, answer: FakeAnswer) {
        *self.answer.lock().expect("policy") = answer;
    }

    /// Every question so far, in order.
    #[must_use]
    #[cfg(test)]
    pub(crate) fn asked(&self) -> Vec<(String, String)> {
        self.asked.lock().expect("policy").clone()
    }
}

#[async_trait::async_trait]
impl ActionsPolicy for FakePolicy {
    async fn allowed(&self, owner: &str, repository: &str) -> Result<bool, PolicyError> {
        self.asked
            .lock()
            .expect("policy")
            .push((owner.to_owned(), repository.to_owned()));
        let answer = self.answer.lock().expect("policy").clone();
        match answer {
            FakeAnswer::Allow => Ok(true),
            FakeAnswer::Deny => Ok(false),
            FakeAnswer::Fail => Err(PolicyError::Unavailable("told to fail".into())),
            FakeAnswer::Hang => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REF: &str = "octo/app/.github/workflows/ci.yml@refs/heads/main";

    #[test]
    fn a_scope_without_an_owner_repository_or_complete_workflow_ref_is_refused() {
        // spec/cache.md §7.3 2.
        let field = |r: Result<CacheScope, ActionsError>| CacheScope::field_of(&r.unwrap_err());
        assert_eq!(field(CacheScope::new("", "app", REF)), "owner");
        assert_eq!(field(CacheScope::new("octo", " ", REF)), "repository");
        assert_eq!(field(CacheScope::new("octo", "app", "")), "workflow_ref");
        assert_eq!(
            CacheScope::new("octo", "app", "octo/app/.github/workflows/ci.yml"),
            Err(ActionsError::WorkflowRefShape(
                "octo/app/.github/workflows/ci.yml".into()
            ))
        );
        assert!(matches!(
            CacheScope::new("octo", "app", "@refs/heads/main"),
            Err(ActionsError::WorkflowRefShape(_))
        ));
        assert!(matches!(
            CacheScope::new("octo", "app", "octo/app/ci.yml@"),
            Err(ActionsError::WorkflowRefShape(_))
        ));
        assert_eq!(
            CacheScope::new(&"o".repeat(101), "app", REF),
            Err(ActionsError::LongName("owner", 101))
        );
        assert!(CacheScope::new(&"o".repeat(100), "app", REF).is_ok());
        assert_eq!(
            CacheScope::new("octo", "org/app", REF),
            Err(ActionsError::Slash("repository"))
        );
        assert_eq!(
            CacheScope::new("octo ", "app", REF),
            Err(ActionsError::ScopeCharacters("owner"))
        );
        assert_eq!(
            CacheScope::new("octo", "app", "a/ci.yml@main\n"),
            Err(ActionsError::ScopeCharacters("workflow_ref"))
        );
        let long = format!("a/ci.yml@{}", "r".repeat(2048));
        assert_eq!(
            CacheScope::new("octo", "app", &long),
            Err(ActionsError::LongWorkflowRef(long.len()))
        );
    }

    #[test]
    fn a_reusable_workflow_of_another_repository_is_a_valid_scope() {
        // spec/cache.md §7.3 3.
        let s =
            CacheScope::new("octo", "app", "other/shared/.github/workflows/build.yml@v1").unwrap();
        assert_eq!((s.owner(), s.repository()), ("octo", "app"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_policy_that_does_not_answer_in_two_seconds_is_a_timeout() {
        let scope = CacheScope::new("octo", "app", REF).unwrap();
        let policy = FakePolicy::new(FakeAnswer::Hang);
        let started = tokio::time::Instant::now();
        assert_eq!(ask(&policy, &scope).await, Err(PolicyError::Timeout));
        assert_eq!(started.elapsed(), POLICY_TIMEOUT);
        policy.set(FakeAnswer::Allow);
        assert_eq!(ask(&policy, &scope).await, Ok(true));
        assert_eq!(ask(&DenyAll, &scope).await, Ok(false));
        assert_eq!(policy.asked().len(), 2);
        assert_eq!(policy.asked()[0], ("octo".to_owned(), "app".to_owned()));
    }
}

#[cfg(test)]
mod proxy_tests;
