//! `billet-plane cache disable|enable` (the Actions cache kill switch): the
//! real binary writes the ledger a running plane reads, so an operator (or a
//! test) flips it while jobs run.

use std::process::Command;
use std::time::Duration;

use billet_controlplane_stub::ledger::{Ledger, LedgerLocation};

fn plane(ledger: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_billet-plane"))
        .arg("--ledger")
        .arg(ledger)
        .args(args)
        .env_remove("BILLET_LEDGER")
        .output()
        .expect("run billet-plane");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_cache_command_blocks_and_lifts_an_organisation_or_a_repository_in_the_ledger() {
    let dir = std::env::temp_dir().join(format!("billet-cache-switch-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ledger.db");
    let ledger = Ledger::connect(
        &LedgerLocation::Sqlite(file.clone()),
        Duration::from_secs(90),
    )
    .await
    .unwrap();
    assert!(ledger.actions_cache_allowed("octo", "hello").await.unwrap());

    let (code, out, err) = plane(&file, &["cache", "disable", "--repository", "Octo/Hello"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("disabled for repository octo/hello"), "{out}");
    assert!(!ledger.actions_cache_allowed("octo", "hello").await.unwrap());
    assert!(ledger.actions_cache_allowed("octo", "other").await.unwrap());

    let (code, out, err) = plane(&file, &["cache", "disable", "--org", "octo"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("disabled for organisation octo"), "{out}");
    assert!(!ledger.actions_cache_allowed("octo", "other").await.unwrap());

    let (code, out, err) = plane(&file, &["cache", "enable", "--org", "octo"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("enabled for organisation octo"), "{out}");
    assert!(ledger.actions_cache_allowed("octo", "other").await.unwrap());
    assert!(
        !ledger.actions_cache_allowed("octo", "hello").await.unwrap(),
        "the repository's own block stays"
    );
    let (code, out, _) = plane(&file, &["cache", "enable", "--repository", "octo/hello"]);
    assert_eq!(code, 0);
    assert!(
        ledger.actions_cache_allowed("octo", "hello").await.unwrap(),
        "{out}"
    );
    let (code, out, _) = plane(&file, &["cache", "enable", "--repository", "octo/hello"]);
    assert_eq!(code, 0);
    assert!(out.contains("(it was already)"), "{out}");

    // A bad name is a usage error naming the flag; nothing is written.
    let (code, _, err) = plane(&file, &["cache", "disable", "--repository", "octo"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--repository") && err.contains("OWNER/NAME"),
        "{err}"
    );
    let (code, _, err) = plane(&file, &["cache", "disable", "--org", "a b"]);
    assert_eq!(code, 2);
    assert!(err.contains("--org"), "{err}");
    let (code, _, err) = plane(&file, &["cache", "disable"]);
    assert_eq!(code, 2, "{err}");
    assert!(ledger.cache_blocks().await.unwrap().is_empty());
    ledger.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
