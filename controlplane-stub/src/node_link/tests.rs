use super::*;

fn link(name: &str) -> Arc<NodeLink> {
    NodeLink::new(NodeTarget {
        name: name.into(),
        addr: "127.0.0.1:9".parse().expect("addr"),
    })
}

fn launch() -> pb::command::Kind {
    pb::command::Kind::Launch(pb::Launch::default())
}

fn destroy() -> pb::command::Kind {
    pb::command::Kind::Destroy(pb::Destroy {
        request_id: 7,
        job_result: None,
        force: false,
        reason: String::new(),
    })
}

fn result(id: &str, outcome: pb::Outcome, custody: bool) -> pb::CommandResult {
    pb::CommandResult {
        id: id.into(),
        outcome: outcome.into(),
        custody,
        error: (outcome != pb::Outcome::Ok).then(|| pb::Error {
            retry_after_ms: 0,
            code: pb::ErrorCode::Unspecified.into(),
            message: "the node says no".into(),
        }),
        instances: None,
    }
}

async fn next(rx: &mut mpsc::Receiver<pb::PlaneMessage>) -> pb::plane_message::Body {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("the plane sent something within 5s")
        .and_then(|m| m.body)
        .expect("a message with a body")
}

async fn command(rx: &mut mpsc::Receiver<pb::PlaneMessage>) -> pb::Command {
    match next(rx).await {
        pb::plane_message::Body::Command(c) => c,
        other => panic!("expected a command, got {other:?}"),
    }
}

async fn ack(rx: &mut mpsc::Receiver<pb::PlaneMessage>) -> pb::ResultAck {
    match next(rx).await {
        pb::plane_message::Body::ResultAck(a) => a,
        other => panic!("expected an acknowledgement, got {other:?}"),
    }
}

fn tombstones(link: &NodeLink) -> Vec<String> {
    link.shared
        .lock()
        .expect("link")
        .tombstones
        .iter()
        .cloned()
        .collect()
}

fn in_flight(link: &NodeLink) -> usize {
    link.shared.lock().expect("link").in_flight.len()
}

/// 7.M.5: what the node answered reaches the caller unchanged: OK,
/// a clean failure (the caller may release), a failure with the custody
/// flag (the node holds the lease), a refusal. Every answer is
/// acknowledged `accepted`.
#[tokio::test]
async fn the_nodes_verdict_reaches_the_caller_as_the_node_gave_it() {
    let link = link("node-a");
    let (tx, mut rx) = link.attach_for_test(1, 16);
    let cases = [
        (pb::Outcome::Ok, false, true, false),
        (pb::Outcome::Failed, false, false, false),
        (pb::Outcome::Failed, true, false, true),
        (pb::Outcome::Refused, false, false, false),
    ];
    for (outcome, custody, ok, held) in cases {
        let dispatch = tokio::spawn({
            let link = Arc::clone(&link);
            async move { link.dispatch(launch(), Duration::from_secs(30)).await }
        });
        let sent = command(&mut rx).await;
        let answer = result(&sent.id, outcome, custody);
        link.answer_for_test(answer.clone(), &tx).await;
        let got = dispatch.await.expect("dispatch");
        assert_eq!(got, CommandOutcome::Answered(answer), "{outcome:?}");
        assert_eq!(got.is_ok(), ok, "{outcome:?} custody={custody}");
        assert_eq!(got.is_custody(), held, "{outcome:?} custody={custody}");
        let acked = ack(&mut rx).await;
        assert_eq!(acked.id, sent.id);
        assert_eq!(acked.verdict, pb::AckVerdict::Accepted as i32);
    }
    assert!(
        tombstones(&link).is_empty(),
        "an answered launch was tombstoned"
    );
    assert_eq!(in_flight(&link), 0);
}

/// 7.M.21: a result that arrived as the deadline passed (taken off the
/// in-flight table and acknowledged `accepted`, its hand-over to the
/// caller not yet done) is the answer, not a loss: otherwise the plane
/// would call it custody while the node was told it was accepted.
// In paused time: the deadline passes on the virtual clock, and the
// sleep past it returns only once every other task is idle.
#[tokio::test(start_paused = true)]
async fn a_result_that_landed_as_the_deadline_passed_is_taken_not_lost() {
    let link = link("node-a");
    // Room for one message: the command, then (once the test fills it)
    // nothing, so the acknowledgement waits while the deadline passes.
    let (tx, mut rx) = link.attach_for_test(1, 1);
    let dispatch = tokio::spawn({
        let link = Arc::clone(&link);
        async move { link.dispatch(launch(), Duration::from_millis(300)).await }
    });
    let sent = command(&mut rx).await;
    tx.try_send(pb::PlaneMessage { body: None })
        .expect("fill the session's buffer");
    let answering = tokio::spawn({
        let (link, tx) = (Arc::clone(&link), tx.clone());
        let answer = result(&sent.id, pb::Outcome::Ok, false);
        async move { link.answer_for_test(answer, &tx).await }
    });
    // The result is in: off the in-flight table, its acknowledgement
    // blocked behind the full buffer.
    tokio::time::timeout(Duration::from_secs(5), async {
        while in_flight(&link) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the result was taken off the in-flight table");
    // The deadline passes with the hand-over still pending.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !dispatch.is_finished(),
        "the dispatch gave up on a result it had"
    );
    assert_eq!(rx.recv().await.map(|m| m.body), Some(None), "the filler");
    let acked = ack(&mut rx).await;
    assert_eq!(acked.verdict, pb::AckVerdict::Accepted as i32);
    answering.await.expect("answer");
    let got = dispatch.await.expect("dispatch");
    assert!(got.is_ok(), "the result was lost: {got:?}");
    assert!(!got.is_custody());
    assert!(
        tombstones(&link).is_empty(),
        "an accepted launch was tombstoned"
    );
}

/// 7.M.33: only a launch that is given up on is tombstoned (its late
/// success is acknowledged `custody`); a lost destroy is sent again
/// rather than tombstoned, and sweeps and tends never take tombstone
/// room. Their late results are acknowledged `accepted`.
#[tokio::test]
async fn only_a_launch_given_up_on_is_tombstoned() {
    let link = link("node-a");
    let (tx, mut rx) = link.attach_for_test(1, 16);
    let kinds = [
        ("launch", launch()),
        ("destroy", destroy()),
        ("sweep", pb::command::Kind::Sweep(pb::Sweep {})),
        ("tend", pb::command::Kind::Tend(pb::Tend {})),
    ];
    let mut ids = Vec::new();
    for (name, kind) in kinds {
        let dispatch = tokio::spawn({
            let link = Arc::clone(&link);
            async move { link.dispatch(kind, Duration::from_millis(100)).await }
        });
        let sent = command(&mut rx).await;
        let got = dispatch.await.expect("dispatch");
        assert!(matches!(got, CommandOutcome::Lost(_)), "{name}: {got:?}");
        ids.push((name, sent.id));
    }
    assert_eq!(tombstones(&link), vec![ids[0].1.clone()]);
    assert_eq!(in_flight(&link), 0);
    for (name, id) in &ids {
        link.answer_for_test(result(id, pb::Outcome::Ok, false), &tx)
            .await;
        let acked = ack(&mut rx).await;
        assert_eq!(&acked.id, id);
        let expected = if *name == "launch" {
            pb::AckVerdict::Custody
        } else {
            pb::AckVerdict::Accepted
        };
        assert_eq!(acked.verdict, expected as i32, "late {name}");
    }
}

/// 7.M.38: a caller that stops waiting (its dispatch dropped) leaves
/// nothing waiting behind it and does not wedge the link: the next
/// command goes through, and the abandoned launch's late success is
/// acknowledged `custody`, so the node holds the lease nobody manages.
#[tokio::test]
async fn a_caller_that_stops_waiting_is_not_stuck_and_its_launch_goes_to_the_node() {
    let link = link("node-a");
    let (tx, mut rx) = link.attach_for_test(1, 16);
    let abandoned = tokio::spawn({
        let link = Arc::clone(&link);
        async move { link.dispatch(launch(), Duration::from_secs(600)).await }
    });
    let sent = command(&mut rx).await;
    abandoned.abort();
    assert!(
        abandoned.await.expect_err("aborted").is_cancelled(),
        "the caller was cancelled"
    );
    assert_eq!(
        in_flight(&link),
        0,
        "the abandoned launch is still waited for"
    );
    assert_eq!(tombstones(&link), vec![sent.id.clone()]);

    let next_dispatch = tokio::spawn({
        let link = Arc::clone(&link);
        async move { link.dispatch(destroy(), Duration::from_secs(30)).await }
    });
    let next_sent = command(&mut rx).await;
    link.answer_for_test(result(&next_sent.id, pb::Outcome::Ok, false), &tx)
        .await;
    assert!(next_dispatch.await.expect("dispatch").is_ok());
    assert_eq!(ack(&mut rx).await.verdict, pb::AckVerdict::Accepted as i32);

    link.answer_for_test(result(&sent.id, pb::Outcome::Ok, false), &tx)
        .await;
    let acked = ack(&mut rx).await;
    assert_eq!(acked.id, sent.id);
    assert_eq!(acked.verdict, pb::AckVerdict::Custody as i32);
}
