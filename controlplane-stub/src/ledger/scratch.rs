//! [`ScratchPostgres`]: a fresh, uniquely named PostgreSQL database made on
//! a server for one test or one benchmark run, and dropped after it. The
//! ledger's PostgreSQL tests and `benches/ledger.rs` use it; a plane never
//! does.
//!
//! The server is the one `scripts/test` installs and starts (Debian's
//! `postgresql`, reached through its socket directory as the OS user, whom
//! `scripts/test` makes a superuser), or the one `BILLET_TEST_POSTGRES_URL`
//! names. A server that does not answer is an error naming `scripts/test`:
//! a test that needs PostgreSQL fails loudly without it.

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection};

use super::LedgerLocation;

/// The environment variable naming the server's maintenance database, as a
/// URL, when it is not the local default ([`DEFAULT_ADMIN_URL`]).
pub(crate) const ADMIN_URL_VAR: &str = "BILLET_TEST_POSTGRES_URL";

/// Debian's `postgresql` on this host, through its socket directory; the
/// OS user is added as `&user=` ([`default_admin_url`]).
pub(crate) const DEFAULT_ADMIN_URL: &str = "postgres:///postgres?host=/var/run/postgresql";

/// [`DEFAULT_ADMIN_URL`] as the OS user (`$USER`, `$LOGNAME`, or what
/// `id -un` prints), whom peer authentication lets in once `scripts/test`
/// made them a role. Neither libpq's nor sqlx's own guess is used: with no
/// `$USER` set (as under CI) sqlx guesses a name no role has.
pub(crate) fn default_admin_url() -> String {
    let user = ["USER", "LOGNAME"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|u| !u.is_empty()))
        .or_else(|| {
            std::process::Command::new("id")
                .arg("-un")
                .output()
                .ok()
                .filter(|out| out.status.success())
                .and_then(|out| String::from_utf8(out.stdout).ok())
                .map(|u| u.trim().to_owned())
                .filter(|u| !u.is_empty())
        });
    match user {
        Some(user) => format!("{DEFAULT_ADMIN_URL}&user={user}"),
        None => DEFAULT_ADMIN_URL.to_owned(),
    }
}

/// A database that exists until [`ScratchPostgres::drop_database`].
#[derive(Debug)]
pub struct ScratchPostgres {
    admin: LedgerLocation,
    name: String,
    location: LedgerLocation,
}

impl ScratchPostgres {
    /// Creates a database named `billet_ledger_<random>` on the server
    /// [`ADMIN_URL_VAR`] names, or on [`default_admin_url`].
    ///
    /// # Errors
    ///
    /// A sentence naming the server (its password redacted), what failed,
    /// and `scripts/test`, when the server cannot be reached or refuses.
    pub async fn create() -> Result<ScratchPostgres, String> {
        let admin_url = std::env::var(ADMIN_URL_VAR).unwrap_or_else(|_| default_admin_url());
        let admin = LedgerLocation::Postgres(admin_url.clone());
        let name = format!("billet_ledger_{}", uuid::Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&admin_url).await.map_err(|e| {
            format!(
                "PostgreSQL is not reachable at {admin}: {e}. The ledger's PostgreSQL tests and \
                 benchmark need a server: run scripts/test, which installs Debian's postgresql, \
                 starts it and makes this user a superuser, or name a server in {ADMIN_URL_VAR}"
            )
        })?;
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .map_err(|e| {
                format!(
                    "PostgreSQL at {admin} refused to create a test database: {e}; scripts/test \
                     makes this user a superuser"
                )
            })?;
        let _ = conn.close().await;
        let location = LedgerLocation::Postgres(with_database(&admin_url, &name));
        Ok(ScratchPostgres {
            admin,
            name,
            location,
        })
    }

    /// Where the ledger is: pass it to [`super::Ledger::connect`].
    pub fn location(&self) -> &LedgerLocation {
        &self.location
    }

    /// Drops the database, disconnecting whoever is still connected.
    ///
    /// # Errors
    ///
    /// A sentence when the server cannot be reached or refuses.
    pub async fn drop_database(&self) -> Result<(), String> {
        let LedgerLocation::Postgres(admin_url) = &self.admin else {
            unreachable!("a scratch database's server is PostgreSQL");
        };
        let mut conn = PgConnection::connect(admin_url)
            .await
            .map_err(|e| format!("cannot reach {} to drop {}: {e}", self.admin, self.name))?;
        sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut conn)
        .await
        .map_err(|e| format!("cannot drop {}: {e}", self.name))?;
        let _ = conn.close().await;
        Ok(())
    }
}

/// `url` with its database (the path) replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let query = tail.split_once('?').map(|(_, q)| q);
    match query {
        Some(q) => format!("{scheme}://{authority}/{database}?{q}"),
        None => format!("{scheme}://{authority}/{database}"),
    }
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn the_scratch_url_names_the_new_database_and_keeps_the_rest() {
        assert_eq!(
            with_database("postgres:///postgres?host=/var/run/postgresql", "x"),
            "postgres:///x?host=/var/run/postgresql"
        );
        assert_eq!(
            with_database("postgres://u:p@h:5432/postgres", "x"),
            "postgres://u:p@h:5432/x"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
    }
}
