//! [`LedgerLocation`]: which backend a ledger runs on and where, parsed from
//! what an operator types (`--ledger`): a `postgres://` URL, a `sqlite:`
//! URL, or a plain path to a SQLite file (the form every earlier release
//! took). A PostgreSQL URL may carry a password, so neither `Debug` nor
//! `Display` ever prints it.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Where the ledger lives.
#[derive(Clone, PartialEq, Eq)]
pub enum LedgerLocation {
    /// A SQLite file, created if missing.
    Sqlite(PathBuf),
    /// A private in-memory SQLite database (`sqlite::memory:`): gone when
    /// the ledger closes.
    SqliteMemory,
    /// A PostgreSQL server, as a libpq-style URL
    /// (`postgres://user:password@host:port/database?sslmode=...`, or a
    /// socket directory as `postgres:///database?host=/var/run/postgresql`).
    /// The database must exist; the ledger creates its tables.
    Postgres(String),
}

impl LedgerLocation {
    /// The location with any password replaced by `***`: what logs and
    /// error messages print.
    pub(crate) fn redacted(&self) -> String {
        match self {
            LedgerLocation::Sqlite(path) => format!("sqlite:{}", path.display()),
            LedgerLocation::SqliteMemory => "sqlite::memory:".to_owned(),
            LedgerLocation::Postgres(url) => redact_password(url),
        }
    }
}

impl From<PathBuf> for LedgerLocation {
    fn from(path: PathBuf) -> Self {
        LedgerLocation::Sqlite(path)
    }
}

impl FromStr for LedgerLocation {
    type Err = String;

    /// `postgres://...` or `postgresql://...` is PostgreSQL;
    /// `sqlite::memory:` is memory; `sqlite://PATH` or `sqlite:PATH` is that
    /// file; anything else is a path to a SQLite file.
    ///
    /// # Errors
    ///
    /// An empty string, or a `sqlite:` URL naming no file.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(
                "the ledger location is empty; give a SQLite file path, sqlite:PATH or \
                        postgres://HOST/DATABASE"
                    .to_owned(),
            );
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(LedgerLocation::Postgres(s.to_owned()));
        }
        if let Some(rest) = s.strip_prefix("sqlite:") {
            if rest == ":memory:" || rest == "//:memory:" {
                return Ok(LedgerLocation::SqliteMemory);
            }
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return Err(format!("the ledger URL {s:?} names no SQLite file"));
            }
            return Ok(LedgerLocation::Sqlite(PathBuf::from(path)));
        }
        Ok(LedgerLocation::Sqlite(PathBuf::from(s)))
    }
}

impl fmt::Display for LedgerLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Debug for LedgerLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LedgerLocation({})", self.redacted())
    }
}

/// `scheme://user:password@host/...` as `scheme://user:***@host/...`; a
/// URL without a password unchanged. A `password=` query parameter is
/// redacted too.
fn redact_password(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some(parts) => parts,
        None => return url.to_owned(),
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{host}"),
            None => format!("{userinfo}@{host}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => {
                        format!("{key}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_path_is_a_sqlite_file_as_before() {
        assert_eq!(
            "billet-ledger.db".parse::<LedgerLocation>().unwrap(),
            LedgerLocation::Sqlite("billet-ledger.db".into())
        );
        assert_eq!(
            "sqlite:///var/lib/billet/ledger.db"
                .parse::<LedgerLocation>()
                .unwrap(),
            LedgerLocation::Sqlite("/var/lib/billet/ledger.db".into())
        );
        assert_eq!(
            "sqlite:ledger.db".parse::<LedgerLocation>().unwrap(),
            LedgerLocation::Sqlite("ledger.db".into())
        );
        assert_eq!(
            "sqlite::memory:".parse::<LedgerLocation>().unwrap(),
            LedgerLocation::SqliteMemory
        );
        assert!("".parse::<LedgerLocation>().is_err());
        assert!("sqlite:".parse::<LedgerLocation>().is_err());
    }

    #[test]
    fn a_postgres_url_never_prints_its_password() {
        for url in [
            "postgres://billet:hunter2@db.internal:5432/ledger",
            "postgresql://billet:hunter2@db.internal/ledger?sslmode=require",
            "postgres://billet@db.internal/ledger?password=hunter2&sslmode=require",
        ] {
            let location: LedgerLocation = url.parse().unwrap();
            assert!(matches!(location, LedgerLocation::Postgres(_)));
            for printed in [location.to_string(), format!("{location:?}")] {
                assert!(!printed.contains("hunter2"), "{printed}");
                assert!(printed.contains("db.internal"), "{printed}");
            }
        }
        let plain: LedgerLocation = "postgres:///ledger?host=/var/run/postgresql"
            .parse()
            .unwrap();
        assert_eq!(
            plain.to_string(),
            "postgres:///ledger?host=/var/run/postgresql"
        );
    }
}
