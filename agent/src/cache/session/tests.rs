use super::*;
use crate::cache::{DiskKey, Policy};
use crate::journal::MemoryJournal;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

fn scratch() -> crate::cache::Scratch {
    crate::cache::Scratch::new("bcs")
}

fn lease(l: &str) -> LeaseId {
    LeaseId::parse("lease", l).unwrap()
}

/// One raw HTTP/1.1 request over the session's socket: status and body.
async fn call(
    dir: &std::path::Path,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, serde_json::Value) {
    let mut stream = tokio::net::UnixStream::connect(dir.join(SOCKET_NAME))
        .await
        .unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap())
}

async fn mounted(store: &Store, sessions: &Sessions, l: &str) -> (Prepared, Mount) {
    let k = DiskKey::parse("npm").unwrap();
    let m = store.mount(&lease(l), &k, Policy::Cas).await.unwrap();
    let p = sessions
        .prepare(&lease(l), vec![Slot::of(&m, "npm", "/cache", "cas")])
        .await
        .unwrap();
    (p, m)
}

/// A guest whose HTTP client gives up on a slow commit (a client
/// timeout shorter than the clone, O(bytes) on ext4) and hangs up.
/// Expected: the commit the node accepted either completes or is
/// undone, and nothing is left on the cache disk; a retried commit is
/// told the truth. Were the handler dropped with the connection, as
/// hyper does, the mount would already be withdrawn, the clone would
/// run on in its blocking task and leave `mounts/<id>.commit` (the
/// disk's size) until the node restarts, nothing would be published,
/// and the retry would be told `fallback`, which says the disk was an
/// empty fallback after a failed clone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_hangs_up_mid_commit_leaks_no_staging_and_is_not_told_fallback() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, ma) = mounted(&store, &sessions, "l1").await;
    // Enough that the clone takes a while without reflinks.
    let chunk = vec![7_u8; 1 << 20];
    for i in 0..300 {
        std::fs::write(ma.dir.join(format!("f{i}")), &chunk).unwrap();
    }
    let mut stream = tokio::net::UnixStream::connect(a.dir.join(SOCKET_NAME))
        .await
        .unwrap();
    let body = r#"{"job_status":"success"}"#;
    let request = format!(
        "POST /v1/volumes/0/commit HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n{body}",
        a.token.expose(),
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    // The guest's client times out and hangs up mid-clone.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    drop(stream);
    // Long enough for any clone and publication to finish.
    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    let staging = root.join("mounts").join(format!("{}.commit", ma.id));
    let head = store.head(&DiskKey::parse("npm").unwrap()).await.unwrap();
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        body,
    )
    .await;
    let mut wrong = Vec::new();
    if staging.exists() {
        wrong.push(format!(
            "the staging clone {} is left on the cache disk",
            staging.display()
        ));
    }
    if head.is_none() {
        wrong.push("nothing was published".to_owned());
    }
    if told["outcome"] == "fallback" {
        wrong.push(format!(
            "the retry was told {told} ({status}), though the disk was no fallback"
        ));
    }
    // The job ends and its compute is gone: its disks are settled and
    // its session closed.
    store.mark_succeeded(&lease("l1")).await.unwrap();
    store.settle(&lease("l1")).await;
    sessions.close(&lease("l1")).await;
    if staging.exists() {
        wrong.push("the staging clone outlives the job's end too".to_owned());
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// The node's own path into a session (`open_settlement`, which a Destroy
/// with `job_result` succeeded calls for every lease with a session, from
/// the single command slot) must not wait for a guest's clone. Were
/// `settle` to hold the session's `slots` mutex across `commit_now`'s
/// whole clone (O(bytes) on ext4), a guest committing a large disk in the
/// background as its job completes would hold the Destroy, and every
/// command queued behind it, for the clone's length: the store's lock,
/// which a clone does not hold, taken again one level up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_settlement_does_not_wait_for_a_guests_clone() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, ma) = mounted(&store, &sessions, "l1").await;
    let chunk = vec![7_u8; 1 << 20];
    for i in 0..600 {
        std::fs::write(ma.dir.join(format!("f{i}")), &chunk).unwrap();
    }
    let dir = a.dir.clone();
    let token = a.token.expose().to_owned();
    let commit = tokio::spawn(async move {
        let began = std::time::Instant::now();
        let answer = call(&dir, Some(&token), "POST", "/v1/volumes/0/commit", "").await;
        (answer, began.elapsed())
    });
    // The guest's request is in its clone.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let began = std::time::Instant::now();
    sessions.open_settlement(&lease("l1")).await;
    let waited = began.elapsed();
    let ((status, told), clone) = commit.await.unwrap();
    assert_eq!(status, 200, "{told}");
    assert_eq!(told["outcome"], "committed", "{told}");
    assert!(
        waited < std::time::Duration::from_millis(250),
        "open_settlement waited {waited:?} for the guest's commit ({clone:?} in all)"
    );
}

#[tokio::test]
async fn a_guest_is_told_its_commit_and_a_second_cas_commit_is_a_conflict() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, ma) = mounted(&store, &sessions, "l1").await;
    let (b, mb) = mounted(&store, &sessions, "l2").await;
    // Journaled before any compute could use it, without the token.
    let records = journal.sessions().await.unwrap();
    assert_eq!(records.len(), 2);
    assert!(
        records
            .iter()
            .all(|r| !r.token_sha256.contains(a.token.expose())
                && !r.slots.contains(a.token.expose()))
    );
    let (status, listed) = call(&a.dir, Some(a.token.expose()), "GET", "/v1/volumes", "").await;
    assert_eq!(status, 200);
    assert_eq!(listed["volumes"][0]["cold"], true);
    assert_eq!(listed["volumes"][0]["key"], "npm");
    std::fs::write(ma.dir.join("n"), "a").unwrap();
    std::fs::write(mb.dir.join("n"), "b").unwrap();
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        r#"{"job_status":"success"}"#,
    )
    .await;
    assert_eq!(
        (status, told.clone()),
        (
            200,
            serde_json::json!({"outcome":"committed","published":true,"generation":1})
        )
    );
    // What the guest writes afterwards reaches no generation.
    std::fs::write(ma.dir.join("n"), "later").unwrap();
    let g1 = store.generation_dir(
        &DiskKey::parse("npm").unwrap(),
        crate::cache::store::Generation(1),
    );
    assert_eq!(std::fs::read_to_string(g1.join("n")).unwrap(), "a");
    let (status, again) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        "",
    )
    .await;
    assert_eq!(status, 409);
    assert_eq!(again["told"], told);
    let (status, told) = call(
        &b.dir,
        Some(b.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        "",
    )
    .await;
    assert_eq!(
        (status, told),
        (
            200,
            serde_json::json!({"outcome":"conflict","published":false,"reason":"conflict","head":1})
        )
    );
    // Settled by their guests: the jobs' ends publish nothing more.
    store.mark_succeeded(&lease("l1")).await.unwrap();
    store.settle(&lease("l1")).await;
    assert_eq!(
        store.head(&DiskKey::parse("npm").unwrap()).await.unwrap(),
        Some(crate::cache::store::Generation(1))
    );
}

/// A guest holding connections open cannot take more than the
/// session's cap of the node's descriptors: the one past it is closed
/// at once, and the guest's API answers again once it lets one go.
#[tokio::test]
async fn a_guests_connections_past_the_cap_are_closed_at_once() {
    const CAP: usize = MAX_SESSION_CONNECTIONS;
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, _) = mounted(&store, &sessions, "l1").await;
    let socket = a.dir.join(SOCKET_NAME);
    let mut idle = Vec::new();
    for _ in 0..CAP {
        idle.push(tokio::net::UnixStream::connect(&socket).await.unwrap());
    }
    let mut over = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let mut buf = [0_u8; 16];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(2), over.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0) | Err(_))),
        "past the cap: closed at once: {closed:?}"
    );
    drop(idle.pop());
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (status, body) = call(&a.dir, Some(a.token.expose()), "GET", "/v1/volumes", "").await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn a_wrong_missing_or_closed_credential_is_refused_and_changes_nothing() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, ma) = mounted(&store, &sessions, "l1").await;
    let (b, _) = mounted(&store, &sessions, "l2").await;
    let wrong = "0".repeat(64);
    for token in [None, Some(wrong.as_str()), Some(""), Some(b.token.expose())] {
        for (method, path) in [
            ("GET", "/v1/volumes"),
            ("POST", "/v1/volumes/0/commit"),
            ("POST", "/nowhere"),
        ] {
            let (status, body) = call(&a.dir, token, method, path, "").await;
            assert_eq!(status, 401, "{method} {path} {body}");
        }
    }
    assert!(
        store.record(&ma.id).await.unwrap().committable,
        "nothing withdrew the disk"
    );
    assert_eq!(
        store.head(&DiskKey::parse("npm").unwrap()).await.unwrap(),
        None
    );
    // Closed when its compute is gone: the socket goes, and its token
    // opens no other session.
    sessions.close(&lease("l1")).await;
    assert!(!a.dir.exists());
    assert!(
        tokio::net::UnixStream::connect(a.dir.join(SOCKET_NAME))
            .await
            .is_err()
    );
    assert!(
        journal
            .sessions()
            .await
            .unwrap()
            .iter()
            .all(|r| r.lease != "l1")
    );
    let (status, _) = call(&b.dir, Some(a.token.expose()), "GET", "/v1/volumes", "").await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn a_restarted_node_still_serves_what_its_guest_mounted() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (a, ma) = {
        let (store, sessions) = opened(&root, &journal).await;
        let made = mounted(&store, &sessions, "l1").await;
        drop(sessions);
        made
    };
    let (_store, sessions) = opened(&root, &journal).await;
    assert_eq!(sessions.open_leases(), vec!["l1".to_owned()]);
    std::fs::write(ma.dir.join("n"), "a").unwrap();
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        "",
    )
    .await;
    assert_eq!((status, told["outcome"].as_str()), (200, Some("committed")));
    let (status, told) = call(&a.dir, Some(a.token.expose()), "GET", "/v1/volumes", "").await;
    assert_eq!(status, 200);
    assert_eq!(told["volumes"][0]["told"]["generation"], 1);
    // An empty listing, with nothing held: the compute is gone.
    sessions.reconcile(&Listed::new([], [])).await;
    assert!(sessions.open_leases().is_empty());
}

/// A node's cache over `root` and `journal`: its store (once a previous
/// one's lock is gone, as after a restart) and its sessions, listening
/// for every session the journal names.
async fn opened(
    root: &std::path::Path,
    journal: &Arc<MemoryJournal>,
) -> (Arc<Store>, Arc<Sessions>) {
    let store = loop {
        match Store::open(root, "dev", journal.clone()).await {
            Ok(s) => break Arc::new(s),
            Err(_) => tokio::task::yield_now().await,
        }
    };
    let sessions = Sessions::open(store.clone()).await;
    (store, sessions)
}

/// The node killed with -9 during a guest's commit, after the commit
/// published and before the guest was told. The guest's client sees
/// its connection cut and asks again of the restarted node, which must
/// not tell it `fallback`, a disk that was never cloned, for a disk
/// that was a hit and whose commit had published. It is told what its
/// commit did: `committed`, with the generation.
#[tokio::test]
async fn a_commit_cut_off_by_a_node_kill_after_it_published_is_told_committed_on_retry() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (a, ma) = {
        let (store, sessions) = opened(&root, &journal).await;
        let (a, ma) = mounted(&store, &sessions, "l1").await;
        std::fs::write(ma.dir.join("n"), "a").unwrap();
        // The commit the guest asked for gets as far as publishing;
        // the node dies before it journals what it told the guest.
        assert_eq!(
            store.commit_now(&ma.id).await.unwrap(),
            Committed::Published(crate::cache::Generation(1))
        );
        drop(sessions);
        (a, ma)
    };
    let (store, sessions) = opened(&root, &journal).await;
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        "",
    )
    .await;
    assert_eq!(status, 200, "{told}");
    assert_eq!(
        (told["outcome"].as_str(), &told["generation"]),
        (Some("committed"), &serde_json::json!(1)),
        "{told}"
    );
    assert_eq!(
        store.head(&DiskKey::parse("npm").unwrap()).await.unwrap(),
        Some(crate::cache::Generation(1))
    );
    sessions.close(&lease("l1")).await;
    drop(ma);
}

/// The same kill, earlier: the commit had withdrawn the disk and not
/// yet published. The retry is told the commit was interrupted
/// (`unavailable`, reason `interrupted`), not that the disk was a
/// fallback, and nothing is published.
#[tokio::test]
async fn a_commit_cut_off_by_a_node_kill_before_it_published_is_told_interrupted_not_fallback() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let a = {
        let (store, sessions) = opened(&root, &journal).await;
        let (a, ma) = mounted(&store, &sessions, "l1").await;
        std::fs::write(ma.dir.join("n"), "a").unwrap();
        // The commit's first step, then the kill.
        store.withdraw(&ma.id).await.unwrap();
        drop(sessions);
        a
    };
    let (store, sessions) = opened(&root, &journal).await;
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        "",
    )
    .await;
    assert_eq!(status, 200, "{told}");
    assert_eq!(
        (told["outcome"].as_str(), told["reason"].as_str()),
        (Some("unavailable"), Some("interrupted")),
        "{told}"
    );
    assert_eq!(told["published"], false);
    assert_eq!(
        store.head(&DiskKey::parse("npm").unwrap()).await.unwrap(),
        None
    );
    sessions.close(&lease("l1")).await;
}

/// A request whose body never comes (a Content-Length the client did
/// not send) must not hold the session's one request at a time, or
/// every other request of the guest is told 429 until that connection
/// closes. The body is read before the session is taken.
#[tokio::test]
async fn a_request_whose_body_stalls_does_not_hold_the_session() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, _ma) = mounted(&store, &sessions, "l1").await;
    let mut stalled = tokio::net::UnixStream::connect(a.dir.join(SOCKET_NAME))
        .await
        .unwrap();
    let request = format!(
        "POST /v1/volumes/0/commit HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: 100\r\n\r\n{{\"job_",
        a.token.expose(),
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (status, listed) = call(&a.dir, Some(a.token.expose()), "GET", "/v1/volumes", "").await;
    assert_eq!(status, 200, "{listed}");
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        "",
    )
    .await;
    assert_eq!(
        (status, told["outcome"].as_str()),
        (200, Some("committed")),
        "{told}"
    );
    drop(stalled);
    sessions.close(&lease("l1")).await;
}

#[tokio::test]
async fn a_failed_job_and_a_fallback_are_told_they_publish_nothing() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, _) = mounted(&store, &sessions, "l1").await;
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        r#"{"job_status":"failure"}"#,
    )
    .await;
    assert_eq!(
        (status, told),
        (
            200,
            serde_json::json!({"outcome":"skipped","published":false,"reason":"job_failed"})
        )
    );
    let k = DiskKey::parse("go").unwrap();
    let m = store.mount(&lease("l2"), &k, Policy::Cas).await.unwrap();
    let mut slot = Slot::of(&m, "go", "/go", "cas");
    slot.fallback = true;
    let b = sessions.prepare(&lease("l2"), vec![slot]).await.unwrap();
    let (status, told) = call(
        &b.dir,
        Some(b.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        "",
    )
    .await;
    assert_eq!((status, told["outcome"].as_str()), (200, Some("fallback")));
    for (body, path) in [
        (r#"{"job_status":"maybe"}"#, "/v1/volumes/1/commit"),
        (r#"{"x":1}"#, "/v1/volumes/0/commit"),
    ] {
        let (status, _) = call(&b.dir, Some(b.token.expose()), "POST", path, body).await;
        assert!(status == 400 || status == 404 || status == 409, "{status}");
    }
    store.mark_succeeded(&lease("l1")).await.unwrap();
    store.settle(&lease("l1")).await;
    store.mark_succeeded(&lease("l2")).await.unwrap();
    store.settle(&lease("l2")).await;
    assert_eq!(
        store.head(&DiskKey::parse("npm").unwrap()).await.unwrap(),
        None
    );
    assert_eq!(store.head(&k).await.unwrap(), None);
}

/// spec/cache.md §7.1 scenario 4, §5.1: an untrusted session's guest
/// that commits is told `untrusted` and publishes nothing.
#[tokio::test]
async fn an_untrusted_guests_commit_is_told_untrusted_and_publishes_nothing() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let k = DiskKey::parse("npm").unwrap();
    let m = store.mount(&lease("l1"), &k, Policy::Cas).await.unwrap();
    let mut slot = Slot::of(&m, "npm", "/cache", "cas");
    slot.untrusted = true;
    let a = sessions.prepare(&lease("l1"), vec![slot]).await.unwrap();
    std::fs::write(m.dir.join("n"), "a").unwrap();
    let (status, told) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/volumes/0/commit",
        r#"{"job_status":"success"}"#,
    )
    .await;
    assert_eq!(
        (status, told),
        (
            200,
            serde_json::json!({"outcome":"skipped","published":false,"reason":"untrusted"})
        )
    );
    assert!(!store.record(&m.id).await.unwrap().committable, "withdrawn");
    store.mark_succeeded(&lease("l1")).await.unwrap();
    store.settle(&lease("l1")).await;
    assert_eq!(store.head(&k).await.unwrap(), None);
    // Journaled: a restarted node still knows the session is untrusted.
    let record = journal.sessions().await.unwrap().remove(0);
    assert!(
        record.slots.contains(r#""untrusted":true"#),
        "{}",
        record.slots
    );
}

/// Slot 0 the Docker image store of `arch`, slot 1 a sticky disk, as
/// the runner mounts them; `untrusted` as the tier is.
async fn with_image_store(
    store: &Store,
    sessions: &Sessions,
    l: &str,
    untrusted: bool,
) -> (Prepared, Mount) {
    let key = DiskKey::docker_images("amd64").unwrap();
    let m = store
        .mount(&lease(l), &key, Policy::LastWriterWins)
        .await
        .unwrap();
    let mut docker = Slot::of(&m, key.as_str(), "/var/lib/docker", "last-writer-wins");
    docker.docker = Some(DockerStore {
        architecture: "amd64".into(),
        settling: false,
        ready: None,
    });
    docker.untrusted = untrusted;
    let npm = store
        .mount(&lease(l), &DiskKey::parse("npm").unwrap(), Policy::Cas)
        .await
        .unwrap();
    let p = sessions
        .prepare(
            &lease(l),
            vec![docker, Slot::of(&npm, "npm", "/cache", "cas")],
        )
        .await
        .unwrap();
    (p, m)
}

const PROOF: &str = r#"{"filesystem":{"type":"dir","uuid":"5f1c","clean":true}}"#;

/// spec/cache.md §7.1 scenarios 7 and 20: the image store is slot 0,
/// keyed by architecture; the guest's request tells it what it has; a
/// commit of slot 0 is 403; a ready before settlement is 409; once the
/// node opened settlement a ready with a proof publishes it, under
/// last-writer-wins, when its lease's mounts are settled.
#[tokio::test]
async fn the_image_store_is_slot_zero_published_only_after_settlement_and_readiness() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let (a, m) = with_image_store(&store, &sessions, "l1", false).await;
    let t = Some(a.token.expose());
    let (status, got) = call(
        &a.dir,
        t,
        "POST",
        "/v1/docker-store",
        r#"{"architecture":"amd64"}"#,
    )
    .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (&got["slot"], &got["key"], &got["path"], &got["cold"]),
        (
            &serde_json::json!(0),
            &serde_json::json!("docker-images/amd64"),
            &serde_json::json!("/var/lib/docker"),
            &serde_json::json!(true)
        )
    );
    let (status, _) = call(
        &a.dir,
        t,
        "POST",
        "/v1/docker-store",
        r#"{"architecture":"arm64"}"#,
    )
    .await;
    assert_eq!(status, 409, "another architecture's store");
    let (status, listed) = call(&a.dir, t, "GET", "/v1/volumes", "").await;
    assert_eq!(status, 200);
    assert_eq!(listed["volumes"][0]["docker"], true);
    assert_eq!(listed["volumes"][1]["docker"], false);
    let (status, _) = call(&a.dir, t, "POST", "/v1/volumes/0/commit", "").await;
    assert_eq!(status, 403, "a commit never publishes the image store");
    let (status, _) = call(&a.dir, t, "POST", "/v1/docker-store/ready", PROOF).await;
    assert_eq!(status, 409, "ready before the node opened settlement");
    for bad in [
        r#"{"filesystem":{"type":"dir","uuid":"5f1c","clean":false}}"#,
        r#"{"filesystem":{"type":" ","uuid":"5f1c","clean":true}}"#,
        r#"{"filesystem":{"type":"dir","uuid":"","clean":true}}"#,
        r#"{}"#,
    ] {
        let (status, _) = call(&a.dir, t, "POST", "/v1/docker-store/ready", bad).await;
        assert_eq!(status, 400, "{bad}");
    }
    assert!(!store.record(&m.id).await.unwrap().succeeded);
    std::fs::write(m.dir.join("image"), "layers").unwrap();
    assert!(sessions.open_settlement(&lease("l1")).await);
    let (status, got) = call(&a.dir, t, "POST", "/v1/docker-store/ready", PROOF).await;
    assert_eq!((status, got), (200, serde_json::json!({"ready": true})));
    let record = journal.sessions().await.unwrap().remove(0);
    assert!(
        record.slots.contains(r#""settling":true"#),
        "{}",
        record.slots
    );
    assert!(
        record.slots.contains(r#""uuid":"5f1c""#),
        "{}",
        record.slots
    );
    sessions.close(&lease("l1")).await;
    store.settle(&lease("l1")).await;
    let key = DiskKey::docker_images("amd64").unwrap();
    assert_eq!(
        store.head(&key).await.unwrap(),
        Some(crate::cache::store::Generation(1))
    );
    let g1 = store.generation_dir(&key, crate::cache::store::Generation(1));
    assert_eq!(std::fs::read_to_string(g1.join("image")).unwrap(), "layers");
    assert_eq!(
        store.head(&DiskKey::parse("npm").unwrap()).await.unwrap(),
        None,
        "the job was never marked succeeded: its sticky disk is discarded"
    );
}

/// spec/cache.md §7.1 scenario 8 and §5.1: without settlement (a job
/// that did not succeed), without readiness, or on an untrusted tier,
/// the image store is discarded once the compute is gone; a job marked
/// succeeded still publishes its sticky disks, never the store.
#[tokio::test]
async fn without_settlement_readiness_or_trust_the_image_store_is_discarded() {
    let root = scratch();
    let journal = Arc::new(MemoryJournal::default());
    let (store, sessions) = opened(&root, &journal).await;
    let key = DiskKey::docker_images("amd64").unwrap();
    // A failed job: no settlement, so a ready is refused.
    let (a, _) = with_image_store(&store, &sessions, "l1", false).await;
    let (status, _) = call(
        &a.dir,
        Some(a.token.expose()),
        "POST",
        "/v1/docker-store/ready",
        PROOF,
    )
    .await;
    assert_eq!(status, 409);
    sessions.close(&lease("l1")).await;
    store.settle(&lease("l1")).await;
    // Succeeded and settling, but the guest never said ready.
    let (_b, _) = with_image_store(&store, &sessions, "l2", false).await;
    store.mark_succeeded(&lease("l2")).await.unwrap();
    assert!(sessions.open_settlement(&lease("l2")).await);
    sessions.close(&lease("l2")).await;
    store.settle(&lease("l2")).await;
    assert_eq!(
        store.head(&DiskKey::parse("npm").unwrap()).await.unwrap(),
        Some(crate::cache::store::Generation(1)),
        "the succeeded job's sticky disk is published"
    );
    // Untrusted: settlement never opens, so a ready is refused.
    let (c, _) = with_image_store(&store, &sessions, "l3", true).await;
    store.mark_succeeded(&lease("l3")).await.unwrap();
    assert!(!sessions.open_settlement(&lease("l3")).await);
    let (status, _) = call(
        &c.dir,
        Some(c.token.expose()),
        "POST",
        "/v1/docker-store/ready",
        PROOF,
    )
    .await;
    assert_eq!(status, 409);
    sessions.close(&lease("l3")).await;
    store.settle(&lease("l3")).await;
    assert_eq!(store.head(&key).await.unwrap(), None, "never published");
    assert!(
        store.mounts().await.is_empty(),
        "each discarded once its compute was gone"
    );
}

/// spec/cache.md §7.1 scenario 9: an unusable architecture is 400, and
/// a tier without an image store answers 404.
#[tokio::test]
async fn an_unusable_architecture_is_refused_and_a_tier_without_a_store_has_none() {
    let root = scratch();
    let store = Arc::new(
        Store::open(&root, "dev", Arc::new(MemoryJournal::default()))
            .await
            .unwrap(),
    );
    let sessions = Sessions::open(store.clone()).await;
    let (a, _) = with_image_store(&store, &sessions, "l1", false).await;
    for arch in ["", "a/b", "amd64\\n", "am d64", "-amd64"] {
        let body = format!(r#"{{"architecture":"{arch}"}}"#);
        let (status, got) = call(
            &a.dir,
            Some(a.token.expose()),
            "POST",
            "/v1/docker-store",
            &body,
        )
        .await;
        assert_eq!(status, 400, "{arch:?}: {got}");
    }
    let (b, _) = mounted(&store, &sessions, "l2").await;
    let (status, _) = call(
        &b.dir,
        Some(b.token.expose()),
        "POST",
        "/v1/docker-store",
        r#"{"architecture":"amd64"}"#,
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = call(
        &b.dir,
        Some(b.token.expose()),
        "POST",
        "/v1/docker-store/ready",
        PROOF,
    )
    .await;
    assert_eq!(status, 404);
}

#[test]
fn a_token_is_64_hex_digits_unique_and_redacted() {
    let a = CacheToken::mint().unwrap();
    let b = CacheToken::mint().unwrap();
    assert_eq!(a.expose().len(), 64);
    assert!(a.expose().bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, b);
    assert_eq!(format!("{a:?}"), "CacheToken(<redacted>)");
    assert!(!format!("{a:?}").contains(a.expose()));
}

#[test]
fn a_digest_survives_its_hex() {
    let d = digest(b"x");
    assert_eq!(unhex(&hex(&d)), Some(d));
    assert_eq!(unhex("zz"), None);
}

#[test]
fn a_slot_is_plain_decimal() {
    assert_eq!(parse_slot("0"), Some(0));
    assert_eq!(parse_slot("4"), Some(4));
    for bad in ["", "+1", "-1", "01", "1a", " 1"] {
        assert_eq!(parse_slot(bad), None, "{bad:?}");
    }
}
