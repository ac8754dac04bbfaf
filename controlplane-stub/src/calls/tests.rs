use super::*;
use crate::ledger::NewLease;

async fn handler() -> (CallHandler, Arc<Ledger>, scaleset::testing::Emulator) {
    let emulator = scaleset::testing::Emulator::builder().start().await;
    let ledger = Arc::new(
        Ledger::open_in_memory(Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let github = Arc::new(Github::new(emulator.client()));
    github.ensure_scale_set("linux").await.unwrap();
    let handler = CallHandler::new(ledger.clone(), github, QUARANTINE_GRACE);
    (handler, ledger, emulator)
}

async fn launching_on(ledger: &Ledger, id: &str, node: &str) -> crate::ledger::Lease {
    let now = crate::now_ms();
    let l = ledger
        .reserve(
            NewLease {
                id: id.into(),
                tier: "linux".into(),
                request_id: 1,
                vcpu: 1,
                memory_bytes: 1 << 20,
                runner_name: Some(format!("billet-{id}")),
            },
            now,
        )
        .await
        .unwrap();
    ledger.bind(id, l.epoch, node, now).await.unwrap();
    ledger
        .advance(id, l.epoch, node, Phase::Launching, now)
        .await
        .unwrap()
}

fn call(call: pb::node_call::Call) -> pb::NodeCall {
    pb::NodeCall {
        call_id: 9,
        call: Some(call),
    }
}

fn test_ca() -> Arc<NodeCa> {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).unwrap();
    Arc::new(NodeCa::from_pem(&cert.pem(), &key.serialize_pem(), Duration::from_secs(600)).unwrap())
}

fn renewal(name: &str) -> pb::NodeCall {
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = rcgen::CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .serialize_request(&key)
        .unwrap()
        .pem()
        .unwrap();
    call(pb::node_call::Call::RenewCertificate(
        pb::RenewCertificate { csr_pem: csr },
    ))
}

/// The plane's CA signs a certificate request only for the node the session
/// authenticated; one naming another node is refused with a typed code, and a
/// plane without a CA key says so.
#[tokio::test]
async fn a_renewal_is_signed_only_for_the_sessions_own_node() {
    let (handler, _ledger, _emulator) = handler().await;
    let refused = handler.handle("node-a", renewal("node-a")).await;
    assert_eq!(
        refused.error.map(|e| e.code),
        Some(pb::ErrorCode::Unavailable as i32),
        "a plane without a CA key signs nothing"
    );
    let handler = handler.with_ca(Some(test_ca()));
    let signed = handler.handle("node-a", renewal("node-a")).await;
    assert!(signed.error.is_none(), "{:?}", signed.error);
    assert!(matches!(
        signed.result,
        Some(pb::plane_reply::Result::Certificate(pb::IssuedCertificate { ref certificate_chain_pem }))
            if certificate_chain_pem.contains("BEGIN CERTIFICATE")
    ));
    let other = handler.handle("node-a", renewal("node-b")).await;
    let e = other.error.expect("refused");
    assert_eq!(
        e.code,
        pb::ErrorCode::IdentityRefused as i32,
        "{}",
        e.message
    );
    assert!(e.message.contains("node-b"), "{}", e.message);
    assert!(other.result.is_none());
    let garbage = handler
        .handle(
            "node-a",
            call(pb::node_call::Call::RenewCertificate(
                pb::RenewCertificate {
                    csr_pem: "not a request".into(),
                },
            )),
        )
        .await;
    assert_eq!(
        garbage.error.map(|e| e.code),
        Some(pb::ErrorCode::IdentityRefused as i32)
    );
}

/// The kill switch: `ActionsPolicyQuery` answers from the ledger's blocks, for
/// any repository, without case; a malformed name is `INVALID_ARGUMENT` and a
/// ledger that cannot be read `UNAVAILABLE` (both a denial to the node).
#[tokio::test]
async fn actions_policy_answers_from_the_ledgers_blocks() {
    use crate::ledger::CacheBlock;
    let (handler, ledger, _emulator) = handler().await;
    let ask = |owner: &str, repository: &str| {
        call(pb::node_call::Call::ActionsPolicy(pb::ActionsPolicyQuery {
            owner: owner.into(),
            repository: repository.into(),
        }))
    };
    let allowed = |reply: pb::PlaneReply| match reply.result {
        Some(pb::plane_reply::Result::ActionsPolicy(a)) if reply.error.is_none() => a.allowed,
        _ => panic!("not answered with a policy: {reply:?}"),
    };
    assert!(allowed(
        handler.handle("node-a", ask("octo", "hello")).await
    ));
    ledger
        .block_cache(&CacheBlock::repository("octo/hello").unwrap(), 1)
        .await
        .unwrap();
    assert!(!allowed(
        handler.handle("node-a", ask("Octo", "Hello")).await
    ));
    assert!(allowed(
        handler.handle("node-b", ask("octo", "other")).await
    ));
    ledger
        .block_cache(&CacheBlock::org("octo").unwrap(), 2)
        .await
        .unwrap();
    assert!(!allowed(
        handler.handle("node-b", ask("octo", "other")).await
    ));
    let code = |reply: &pb::PlaneReply| reply.error.as_ref().map(|e| e.code);
    let bad = handler.handle("node-a", ask("octo", "a/b")).await;
    assert_eq!(
        code(&bad),
        Some(pb::ErrorCode::InvalidArgument as i32),
        "{bad:?}"
    );
    ledger.close().await;
    let down = handler.handle("node-a", ask("octo", "hello")).await;
    assert_eq!(
        code(&down),
        Some(pb::ErrorCode::Unavailable as i32),
        "{down:?}"
    );
}

/// `RecordCacheObservation` records what a node's cache did against the lease
/// at its epoch, after the release too, answered with the observation the
/// ledger keeps (the first); a stale epoch is `FENCED`, an unknown lease
/// `NOT_FOUND`.
#[tokio::test]
async fn record_cache_observation_keeps_the_first_fenced_by_epoch() {
    let (handler, ledger, _emulator) = handler().await;
    let reserved = ledger
        .reserve(
            NewLease {
                id: "l1".into(),
                tier: "linux".into(),
                request_id: 1,
                vcpu: 1,
                memory_bytes: 1 << 20,
                runner_name: Some("billet-l1".into()),
            },
            crate::now_ms(),
        )
        .await
        .unwrap();
    ledger
        .release("l1", reserved.epoch, None, Phase::Done, crate::now_ms())
        .await
        .unwrap();
    let record = |lease: &str, epoch: u64, hits: u64| {
        call(pb::node_call::Call::RecordCacheObservation(
            pb::RecordCacheObservation {
                lease_id: lease.into(),
                epoch,
                observation: Some(pb::CacheObservation {
                    hits,
                    misses: 2,
                    fallbacks: 0,
                    bytes_restored: 4,
                    bytes_committed: 5,
                    conflicts: 1,
                }),
            },
        ))
    };
    let code = |reply: &pb::PlaneReply| reply.error.as_ref().map(|e| e.code);
    let fenced = handler
        .handle("node-a", record("l1", reserved.epoch + 1, 1))
        .await;
    assert_eq!(
        code(&fenced),
        Some(pb::ErrorCode::Fenced as i32),
        "{fenced:?}"
    );
    let unknown = handler.handle("node-a", record("l9", 1, 1)).await;
    assert_eq!(
        code(&unknown),
        Some(pb::ErrorCode::NotFound as i32),
        "{unknown:?}"
    );
    let first = handler
        .handle("node-a", record("l1", reserved.epoch, 1))
        .await;
    assert!(first.error.is_none(), "{:?}", first.error);
    let second = handler
        .handle("node-a", record("l1", reserved.epoch, 7))
        .await;
    assert!(second.error.is_none(), "{:?}", second.error);
    let Some(pb::plane_reply::Result::CacheObservation(kept)) = second.result else {
        panic!("not answered with the observation: {second:?}");
    };
    assert_eq!(
        (kept.hits, kept.misses, kept.conflicts),
        (1, 2, 1),
        "the first is kept"
    );
    assert_eq!(
        ledger
            .cache_observation("l1")
            .await
            .unwrap()
            .map(|o| o.hits),
        Some(1)
    );
}

/// `Resize` changes what a launching lease charges to what its node runs,
/// fenced and checked against the capacity the session's node reported; a plane
/// that does not know it yet answers `UNAVAILABLE`, and a size beyond the room
/// is `REFUSED` with nothing written.
#[tokio::test]
async fn resize_charges_what_the_node_runs_within_the_room_it_reported() {
    let (handler, ledger, _emulator) = handler().await;
    let reserved = ledger
        .reserve(
            NewLease {
                id: "l1".into(),
                tier: "linux".into(),
                request_id: 1,
                vcpu: 4,
                memory_bytes: 1 << 20,
                runner_name: Some("billet-l1".into()),
            },
            crate::now_ms(),
        )
        .await
        .unwrap();
    let bound = handler
        .handle(
            "node-a",
            call(pb::node_call::Call::BindAdvance(pb::BindAdvance {
                lease_id: "l1".into(),
                epoch: reserved.epoch,
                phase: "launching".into(),
            })),
        )
        .await;
    assert!(bound.error.is_none(), "{:?}", bound.error);
    let resize = |epoch: u64, vcpu: u32| {
        call(pb::node_call::Call::Resize(pb::Resize {
            lease_id: "l1".into(),
            epoch,
            vcpu,
            memory_bytes: 1 << 20,
        }))
    };
    let room = pb::Capacity {
        vcpu: 8,
        memory_bytes: 1 << 30,
    };
    let code = |reply: pb::PlaneReply| reply.error.map(|e| e.code);
    assert_eq!(
        code(handler.handle("node-a", resize(reserved.epoch, 2)).await),
        Some(pb::ErrorCode::Unavailable as i32),
        "resized without knowing the node's room"
    );
    assert_eq!(
        code(
            handler
                .handle_from("node-a", Some(room), resize(reserved.epoch + 1, 2))
                .await
        ),
        Some(pb::ErrorCode::Fenced as i32)
    );
    assert_eq!(
        code(
            handler
                .handle_from("node-a", Some(room), resize(reserved.epoch, 9))
                .await
        ),
        Some(pb::ErrorCode::Refused as i32)
    );
    assert_eq!(ledger.get("l1").await.unwrap().unwrap().vcpu, 4);
    let reply = handler
        .handle_from("node-a", Some(room), resize(reserved.epoch, 2))
        .await;
    assert!(reply.error.is_none(), "{:?}", reply.error);
    let Some(pb::plane_reply::Result::Lease(lease)) = reply.result else {
        panic!("not answered with the lease: {reply:?}");
    };
    assert_eq!(lease.vcpu, 2);
    assert_eq!(ledger.get("l1").await.unwrap().unwrap().vcpu, 2);
}

/// `BindAdvance` binds the lease to the session's node and moves it to the
/// phase asked in one call, answered with the lease as the ledger then holds
/// it; refusals carry the codes Bind and Advance carry, and a phase that is not
/// one is an invalid argument.
#[tokio::test]
async fn bind_advance_answers_the_lease_bound_and_launching() {
    let (handler, ledger, _emulator) = handler().await;
    let reserved = ledger
        .reserve(
            NewLease {
                id: "l1".into(),
                tier: "linux".into(),
                request_id: 1,
                vcpu: 1,
                memory_bytes: 1 << 20,
                runner_name: Some("billet-l1".into()),
            },
            crate::now_ms(),
        )
        .await
        .unwrap();
    let ask = |epoch: u64, phase: &str| {
        call(pb::node_call::Call::BindAdvance(pb::BindAdvance {
            lease_id: "l1".into(),
            epoch,
            phase: phase.into(),
        }))
    };
    let reply = handler
        .handle("node-a", ask(reserved.epoch, "launching"))
        .await;
    assert!(reply.error.is_none(), "{:?}", reply.error);
    let Some(pb::plane_reply::Result::Lease(lease)) = reply.result else {
        panic!("not answered with the lease: {reply:?}");
    };
    assert_eq!(
        (lease.id.as_str(), lease.node.as_str(), lease.phase.as_str()),
        ("l1", "node-a", "launching")
    );
    let held = ledger.get("l1").await.unwrap().unwrap();
    assert_eq!(
        (held.node.as_deref(), held.phase),
        (Some("node-a"), Phase::Launching)
    );
    let code = |reply: pb::PlaneReply| reply.error.map(|e| e.code);
    assert_eq!(
        code(
            handler
                .handle("node-a", ask(reserved.epoch + 1, "launching"))
                .await
        ),
        Some(pb::ErrorCode::Fenced as i32)
    );
    assert_eq!(
        code(
            handler
                .handle("node-b", ask(reserved.epoch, "launching"))
                .await
        ),
        Some(pb::ErrorCode::WrongNode as i32)
    );
    assert_eq!(
        code(handler.handle("node-a", ask(reserved.epoch, "busy")).await),
        Some(pb::ErrorCode::BadTransition as i32)
    );
    assert_eq!(
        code(
            handler
                .handle("node-a", ask(reserved.epoch, "sideways"))
                .await
        ),
        Some(pb::ErrorCode::InvalidArgument as i32)
    );
    assert_eq!(
        ledger.get("l1").await.unwrap().unwrap(),
        held,
        "a refusal wrote"
    );
}

#[tokio::test]
async fn a_node_asking_for_another_nodes_lease_is_refused_and_the_lease_is_untouched() {
    let (handler, ledger, emulator) = handler().await;
    let lease = launching_on(&ledger, "theirs", "node-a").await;
    let attempts = [
        pb::node_call::Call::GetLease(pb::GetLease {
            lease_id: "theirs".into(),
        }),
        pb::node_call::Call::Heartbeat(pb::Heartbeat {
            leases: vec![pb::LeaseEpoch {
                lease_id: "theirs".into(),
                epoch: lease.epoch,
            }],
        }),
        pb::node_call::Call::Advance(pb::Advance {
            lease_id: "theirs".into(),
            epoch: lease.epoch,
            phase: "custody".into(),
        }),
        pb::node_call::Call::Release(pb::Release {
            lease_id: "theirs".into(),
            epoch: lease.epoch,
            outcome: "failed".into(),
            ..Default::default()
        }),
        pb::node_call::Call::Bind(pb::Bind {
            lease_id: "theirs".into(),
            epoch: lease.epoch,
        }),
        pb::node_call::Call::BindAdvance(pb::BindAdvance {
            lease_id: "theirs".into(),
            epoch: lease.epoch,
            phase: "launching".into(),
        }),
        pb::node_call::Call::MintJit(pb::MintJit {
            lease_id: "theirs".into(),
            epoch: lease.epoch,
            runner_name: "billet-theirs".into(),
            work_folder: "_work".into(),
        }),
        pb::node_call::Call::RemoveRunner(pb::RemoveRunner {
            lease_id: "theirs".into(),
            epoch: lease.epoch,
            runner_id: 0,
            runner_name: String::new(),
        }),
        pb::node_call::Call::MarkFailure(pb::MarkFailure {
            lease_id: "theirs".into(),
            epoch: lease.epoch,
            reason: "x".into(),
            ..Default::default()
        }),
    ];
    for attempt in attempts {
        let reply = handler.handle("node-b", call(attempt.clone())).await;
        let refused = match (&reply.error, &reply.result) {
            (Some(e), _) => e.code == pb::ErrorCode::WrongNode as i32,
            (None, Some(pb::plane_reply::Result::Heartbeats(h))) => h.results.iter().all(|r| {
                r.error
                    .as_ref()
                    .is_some_and(|e| e.code == pb::ErrorCode::WrongNode as i32)
            }),
            _ => false,
        };
        assert!(
            refused,
            "{attempt:?} was not refused as wrong node: {reply:?}"
        );
    }
    assert_eq!(
        ledger.get("theirs").await.unwrap(),
        Some(lease),
        "the lease changed"
    );
    assert!(
        emulator.state().runners.is_empty(),
        "a runner was minted for another node's lease"
    );
}

#[tokio::test]
async fn a_jit_config_is_minted_once_per_lease_and_only_while_launching() {
    let (handler, ledger, _emulator) = handler().await;
    let lease = launching_on(&ledger, "mine", "node-a").await;
    let mint = || {
        call(pb::node_call::Call::MintJit(pb::MintJit {
            lease_id: "mine".into(),
            epoch: lease.epoch,
            runner_name: "billet-mine".into(),
            work_folder: "_work".into(),
        }))
    };
    let first = handler.handle("node-a", mint()).await;
    assert!(first.error.is_none(), "{first:?}");
    let second = handler.handle("node-a", mint()).await;
    assert_eq!(
        second.error.map(|e| e.code),
        Some(pb::ErrorCode::Refused as i32)
    );
    let wrong_name = handler
        .handle(
            "node-a",
            call(pb::node_call::Call::MintJit(pb::MintJit {
                lease_id: "mine".into(),
                epoch: lease.epoch,
                runner_name: "someone-else".into(),
                work_folder: "_work".into(),
            })),
        )
        .await;
    assert!(wrong_name.error.is_some());
}

/// 7.O.11: a failure reason the node marks over the wire reaches the
/// ledger, and comes back to the node on its next lease read.
#[tokio::test]
async fn a_failure_reason_marked_over_the_wire_reaches_the_ledger_and_comes_back_on_a_read() {
    let (handler, ledger, _emulator) = handler().await;
    let lease = launching_on(&ledger, "mine", "node-a").await;
    let marked = handler
        .handle(
            "node-a",
            call(pb::node_call::Call::MarkFailure(pb::MarkFailure {
                lease_id: "mine".into(),
                epoch: lease.epoch,
                reason: "the host lost its disk".into(),
                ..Default::default()
            })),
        )
        .await;
    assert!(marked.error.is_none(), "{marked:?}");
    assert_eq!(
        ledger
            .get("mine")
            .await
            .unwrap()
            .and_then(|l| l.failure_reason)
            .as_deref(),
        Some("the host lost its disk")
    );
    let read = handler
        .handle(
            "node-a",
            call(pb::node_call::Call::GetLease(pb::GetLease {
                lease_id: "mine".into(),
            })),
        )
        .await;
    match read.result {
        Some(pb::plane_reply::Result::Lease(l)) => {
            assert_eq!(l.failure_reason, "the host lost its disk");
        }
        other => panic!("no lease in the reply: {other:?} {:?}", read.error),
    }
    // A lease without one reads back empty, which the node takes as none.
    let clean = launching_on(&ledger, "clean", "node-a").await;
    let read = handler
        .handle(
            "node-a",
            call(pb::node_call::Call::GetLease(pb::GetLease {
                lease_id: clean.id.clone(),
            })),
        )
        .await;
    let Some(pb::plane_reply::Result::Lease(l)) = read.result else {
        panic!("no lease in the reply: {:?}", read.error);
    };
    assert_eq!(l.failure_reason, "");
}

/// A lease's end travels as a code: the node's code and detail reach the
/// ledger and come back on a read with their class; the first code stays;
/// a node that names no code (one that predates them) has its words read.
#[tokio::test]
async fn an_end_named_over_the_wire_is_kept_as_its_code_and_read_back_with_its_class() {
    use billet_proto::ending::{EndClass, ReasonCode};
    let (handler, ledger, _emulator) = handler().await;
    let lease = launching_on(&ledger, "spot", "node-a").await;
    let send = |call_body| handler.handle("node-a", call(call_body));
    let marked = send(pb::node_call::Call::MarkFailure(pb::MarkFailure {
        lease_id: "spot".into(),
        epoch: lease.epoch,
        reason: "ec2 spot interruption: terminate".into(),
        code: pb::EndReason::SpotInterruption.into(),
        detail: "terminate".into(),
    }))
    .await;
    assert!(marked.error.is_none(), "{marked:?}");
    let released = send(pb::node_call::Call::Release(pb::Release {
        lease_id: "spot".into(),
        epoch: lease.epoch,
        outcome: "failed".into(),
        code: pb::EndReason::Killed.into(),
        detail: String::new(),
    }))
    .await;
    assert!(released.error.is_none(), "{released:?}");
    let ended = ledger.get("spot").await.unwrap().expect("the lease");
    let end = ended.end().expect("ended");
    assert_eq!(end, (ReasonCode::SpotInterruption, "terminate".to_owned()));
    assert_eq!(end.0.class(), EndClass::Infra);
    let read = send(pb::node_call::Call::GetLease(pb::GetLease {
        lease_id: "spot".into(),
    }))
    .await;
    let Some(pb::plane_reply::Result::Lease(l)) = read.result else {
        panic!("no lease in the reply: {:?}", read.error);
    };
    assert_eq!(l.end_reason, pb::EndReason::SpotInterruption as i32);
    assert_eq!(l.end_detail, "terminate");

    // Done, named as completed; and an older node's words, read.
    let done = launching_on(&ledger, "done", "node-a").await;
    let released = send(pb::node_call::Call::Release(pb::Release {
        lease_id: "done".into(),
        epoch: done.epoch,
        outcome: "done".into(),
        code: pb::EndReason::Completed.into(),
        detail: String::new(),
    }))
    .await;
    assert!(released.error.is_none(), "{released:?}");
    let done = ledger.get("done").await.unwrap().expect("the lease");
    assert_eq!(done.end(), Some((ReasonCode::Completed, String::new())));
    let old = launching_on(&ledger, "old", "node-a").await;
    for body in [
        pb::node_call::Call::MarkFailure(pb::MarkFailure {
            lease_id: "old".into(),
            epoch: old.epoch,
            reason: "exit 3".into(),
            ..Default::default()
        }),
        pb::node_call::Call::Release(pb::Release {
            lease_id: "old".into(),
            epoch: old.epoch,
            outcome: "failed".into(),
            ..Default::default()
        }),
    ] {
        let reply = send(body).await;
        assert!(reply.error.is_none(), "{reply:?}");
    }
    let old = ledger.get("old").await.unwrap().expect("the lease");
    assert_eq!(old.end(), Some((ReasonCode::RunnerExit, "3".to_owned())));
    assert_eq!(old.end().map(|(c, _)| c.class()), Some(EndClass::Job));
    let open = launching_on(&ledger, "open", "node-a").await;
    assert_eq!(open.end(), None, "an open lease has not ended");
}

/// 7.O.21: only a verdict is permanent. GitHub refusing to remove a
/// runner that is running a job is an answer (`REFUSED`: the node keeps
/// the runner); GitHub failing is an outage (`UNAVAILABLE`: the node
/// retries), never a verdict.
#[tokio::test]
async fn a_busy_runner_is_a_refusal_and_a_github_outage_is_unavailable() {
    let emulator = scaleset::testing::Emulator::builder().start().await;
    let ledger = Arc::new(
        Ledger::open_in_memory(Duration::from_secs(60))
            .await
            .unwrap(),
    );
    // No client-side retries, so an injected failure reaches the handler.
    let client = emulator
        .client()
        .with_retry_policy(scaleset::RetryPolicy::none());
    let github = Arc::new(Github::new(client));
    github.ensure_scale_set("linux").await.unwrap();
    let handler = CallHandler::new(ledger.clone(), github.clone(), QUARANTINE_GRACE);
    let lease = launching_on(&ledger, "busy", "node-a").await;
    let minted = handler
        .handle(
            "node-a",
            call(pb::node_call::Call::MintJit(pb::MintJit {
                lease_id: "busy".into(),
                epoch: lease.epoch,
                runner_name: "billet-busy".into(),
                work_folder: "_work".into(),
            })),
        )
        .await;
    assert!(minted.error.is_none(), "{minted:?}");
    let set = github.ensure_scale_set("linux").await.unwrap();
    let job = emulator.queue_job(set, Vec::<String>::new());
    let session = emulator
        .client()
        .create_message_session(set, "test")
        .await
        .unwrap();
    assert_eq!(session.acquire_jobs(&[job]).await.unwrap(), vec![job]);
    emulator.start_job(job, Some("billet-busy"));
    let remove = || {
        call(pb::node_call::Call::RemoveRunner(pb::RemoveRunner {
            lease_id: "busy".into(),
            epoch: lease.epoch,
            runner_id: 0,
            runner_name: String::new(),
        }))
    };

    let busy = handler.handle("node-a", remove()).await;
    assert_eq!(
        busy.error.as_ref().map(|e| e.code),
        Some(pb::ErrorCode::Busy as i32),
        "{busy:?}"
    );
    assert_eq!(
        emulator.state().runners.len(),
        1,
        "the busy runner was removed"
    );

    emulator.inject(scaleset::testing::Fault::status(
        scaleset::testing::Endpoint::Runners,
        500,
    ));
    let outage = handler.handle("node-a", remove()).await;
    assert_eq!(
        outage.error.as_ref().map(|e| e.code),
        Some(pb::ErrorCode::Unavailable as i32),
        "{outage:?}"
    );
    emulator.clear_faults();

    // Once the job is over the same call succeeds: the refusal was
    // about now, and the node asks again. GitHub let the ephemeral
    // runner go with its job, and the answer says so (what the start
    // deadline reads as "it took a job").
    emulator.complete_job(job, None);
    let after = handler.handle("node-a", remove()).await;
    assert!(after.error.is_none(), "{after:?}");
    assert_eq!(
        after.result,
        Some(pb::plane_reply::Result::RunnerRemoval(pb::RunnerRemoval {
            already_gone: true
        })),
        "{after:?}"
    );
    let _ = session.close().await;
}

/// A scale set GitHub no longer has is a typed answer naming the set,
/// and it is believed for the retry interval: a second mint within it
/// reaches GitHub not at all.
#[tokio::test]
async fn a_deleted_scale_set_is_a_typed_answer_and_is_not_asked_again_within_the_interval() {
    let (handler, ledger, emulator) = handler().await;
    let set = emulator.state().scale_sets[0].id;
    emulator
        .client()
        .delete_runner_scale_set(set)
        .await
        .unwrap();
    let mint = |id: &str, epoch| {
        call(pb::node_call::Call::MintJit(pb::MintJit {
            lease_id: id.into(),
            epoch,
            runner_name: format!("billet-{id}"),
            work_folder: "_work".into(),
        }))
    };
    let first = launching_on(&ledger, "first", "node-a").await;
    let before = emulator.requests().len();
    let reply = handler.handle("node-a", mint("first", first.epoch)).await;
    let error = reply.error.expect("an error");
    assert_eq!(
        error.code,
        pb::ErrorCode::ScaleSetNotFound as i32,
        "{error:?}"
    );
    assert!(error.message.contains("\"linux\""), "{}", error.message);
    let asked = emulator.requests().len();
    assert!(asked > before, "GitHub was not asked at all");

    let second = launching_on(&ledger, "second", "node-a").await;
    let reply = handler.handle("node-a", mint("second", second.epoch)).await;
    assert_eq!(
        reply.error.map(|e| e.code),
        Some(pb::ErrorCode::ScaleSetNotFound as i32)
    );
    assert_eq!(
        emulator.requests().len(),
        asked,
        "a mint for a set known missing reached GitHub"
    );
}
