//! A tier's Actions cache scope, checked: whose cache the tier's jobs read
//! and write (spec/cache.md §2.2). The proxy acts on it
//! (the `cache::actions` module); the wire and the runner only carry it.

use thiserror::Error;

/// Longest owner or repository name, in bytes (spec/cache.md §2.2).
pub const MAX_NAME_BYTES: usize = 100;

/// Longest workflow ref, in bytes (spec/cache.md §2.2).
pub const MAX_WORKFLOW_REF_BYTES: usize = 2048;

/// Why something the Actions cache was given is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ActionsError {
    /// A scope field is empty or blank.
    #[error("{0} is empty; the tier's cache_scope names the repository whose workflows use it")]
    BlankScope(&'static str),
    /// A scope field has surrounding whitespace, NUL, CR or LF.
    #[error("{0} has surrounding whitespace, NUL, CR or LF; remove them")]
    ScopeCharacters(&'static str),
    /// The owner or repository is longer than [`MAX_NAME_BYTES`].
    #[error("{0} is {1} bytes; at most {MAX_NAME_BYTES} are allowed")]
    LongName(&'static str, usize),
    /// The owner or repository contains a `/`.
    #[error("{0} contains \"/\"; give the owner and the repository's own name apart")]
    Slash(&'static str),
    /// The workflow ref is longer than [`MAX_WORKFLOW_REF_BYTES`].
    #[error("workflow_ref is {0} bytes; at most {MAX_WORKFLOW_REF_BYTES} are allowed")]
    LongWorkflowRef(usize),
    /// The workflow ref is not `<workflow path>@<ref>`.
    #[error(
        "workflow_ref {0:?} is not <workflow path>@<ref>, e.g. \"octo/app/.github/workflows/ci.yml@refs/heads/main\""
    )]
    WorkflowRefShape(String),
}

/// A tier's static Actions cache scope (proto `CacheScope`): whose cache
/// the tier's jobs read and write. Taken from the tier, never from the job
/// GitHub assigns later (spec/cache.md §2.2: the assignment that scaled up
/// is not the job that runs). Checked as the reference's
/// `validateActionsScope`: each part non-blank, no surrounding whitespace,
/// no NUL, CR or LF; owner and repository at most [`MAX_NAME_BYTES`] and
/// without `/`; the workflow ref at most [`MAX_WORKFLOW_REF_BYTES`], a
/// non-blank workflow path and a non-blank ref split at the first `@` (a
/// reusable workflow of another repository is accepted).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct CacheScope {
    owner: String,
    repository: String,
    workflow_ref: String,
}

fn plain(field: &'static str, value: &str) -> Result<(), ActionsError> {
    if value.trim().is_empty() {
        return Err(ActionsError::BlankScope(field));
    }
    if value.trim() != value || value.contains(['\0', '\r', '\n']) {
        return Err(ActionsError::ScopeCharacters(field));
    }
    Ok(())
}

fn name(field: &'static str, value: &str) -> Result<(), ActionsError> {
    plain(field, value)?;
    if value.len() > MAX_NAME_BYTES {
        return Err(ActionsError::LongName(field, value.len()));
    }
    if value.contains('/') {
        return Err(ActionsError::Slash(field));
    }
    Ok(())
}

impl CacheScope {
    /// Checks a scope.
    ///
    /// # Errors
    ///
    /// The [`ActionsError`] of the first part at fault; its first word
    /// names the part (`owner`, `repository`, `workflow_ref`):
    /// [`CacheScope::field_of`].
    pub fn new(owner: &str, repository: &str, workflow_ref: &str) -> Result<Self, ActionsError> {
        name("owner", owner)?;
        name("repository", repository)?;
        plain("workflow_ref", workflow_ref)?;
        if workflow_ref.len() > MAX_WORKFLOW_REF_BYTES {
            return Err(ActionsError::LongWorkflowRef(workflow_ref.len()));
        }
        match workflow_ref.split_once('@') {
            Some((path, r)) if !path.trim().is_empty() && !r.trim().is_empty() => {}
            _ => return Err(ActionsError::WorkflowRefShape(workflow_ref.to_owned())),
        }
        Ok(Self {
            owner: owner.to_owned(),
            repository: repository.to_owned(),
            workflow_ref: workflow_ref.to_owned(),
        })
    }

    /// The part of a scope an error is about: `owner`, `repository` or
    /// `workflow_ref`.
    #[must_use]
    pub(crate) fn field_of(error: &ActionsError) -> &'static str {
        match error {
            ActionsError::BlankScope(f)
            | ActionsError::ScopeCharacters(f)
            | ActionsError::LongName(f, _)
            | ActionsError::Slash(f) => f,
            ActionsError::LongWorkflowRef(_) | ActionsError::WorkflowRefShape(_) => "workflow_ref",
        }
    }

    /// The repository's owner (the kill switch's first key).
    #[must_use]
    pub(crate) fn owner(&self) -> &str {
        &self.owner
    }

    /// The repository's own name (the kill switch's second key).
    #[must_use]
    pub(crate) fn repository(&self) -> &str {
        &self.repository
    }

    /// `<workflow path>@<ref>`.
    #[must_use]
    pub(crate) fn workflow_ref(&self) -> &str {
        &self.workflow_ref
    }
}
