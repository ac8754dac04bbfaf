//! The ledger's throughput on both backends, side by side: reservations per
//! second (`reserve_on`, the capacity-checked path the plane takes) and
//! heartbeats per second (single `heartbeat` calls, and leases renewed per
//! second through batched `heartbeat_all` calls of 50), each one call at a time
//! and with 16 in flight. PostgreSQL's figure is also given as a ratio against
//! SQLite's, measured in the same run.
//!
//! SQLite is a file in the temp directory (WAL, `synchronous = FULL`: one
//! fsync per commit); PostgreSQL is a scratch database on the server
//! `scripts/test` starts (Debian's defaults: `fsync` on), or the one
//! `BILLET_TEST_POSTGRES_URL` names, dropped afterwards.
//!
//! ```text
//! cargo bench -p billet-controlplane-stub --bench ledger
//! BILLET_BENCH_LEDGER_OPS=2000 cargo bench -p billet-controlplane-stub --bench ledger
//! ```
//!
//! `BILLET_BENCH_LEDGER_OPS` (default 1000) is how many calls each figure
//! makes. Bounded: every loop runs a fixed count against local databases.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use billet_controlplane_stub::ledger::scratch::ScratchPostgres;
use billet_controlplane_stub::ledger::{
    Backend, Ledger, LedgerLocation, NewLease, NodeCapacity, Phase,
};

const TTL: Duration = Duration::from_secs(90);
const BATCH: usize = 50;
const IN_FLIGHT: usize = 16;
const NODES: usize = 4;

/// Room for every reservation the benchmark makes.
const ROOM: NodeCapacity = NodeCapacity {
    vcpu: 1 << 40,
    memory_bytes: 1 << 60,
};

fn new_lease(id: String) -> NewLease {
    NewLease {
        runner_name: Some(format!("billet-{id}")),
        id,
        tier: "bench".to_owned(),
        request_id: 1,
        vcpu: 1,
        memory_bytes: 1 << 30,
    }
}

/// Runs `ops` calls of `call(i)`, `in_flight` at a time; returns calls per
/// second.
async fn rate<F, Fut>(ops: usize, in_flight: usize, call: F) -> Result<f64>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    let call = Arc::new(call);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..in_flight {
        let call = Arc::clone(&call);
        let next = Arc::clone(&next);
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= ops {
                    return Ok::<_, anyhow::Error>(());
                }
                call(i).await?;
            }
        });
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    Ok(ops as f64 / started.elapsed().as_secs_f64())
}

/// Every figure, in [`FIGURES`]' order, on one backend.
async fn measure(location: &LedgerLocation, ops: usize) -> Result<Vec<f64>> {
    let ledger = Arc::new(
        Ledger::connect(location, TTL)
            .await
            .with_context(|| format!("open the ledger at {location}"))?,
    );
    let backend = ledger.backend();
    let mut figures = Vec::new();
    for (round, in_flight) in [(0, 1), (1, IN_FLIGHT)] {
        let l = Arc::clone(&ledger);
        figures.push(
            rate(ops, in_flight, move |i| {
                let l = Arc::clone(&l);
                async move {
                    let node = format!("n{}", i % NODES);
                    l.reserve_on(new_lease(format!("r{round}-{i}")), &node, ROOM, 0)
                        .await?;
                    Ok(())
                }
            })
            .await?,
        );
    }
    // Leases to renew: 50 on each node, bound and launching.
    let mut held: Vec<Vec<(String, u64)>> = vec![Vec::new(); NODES];
    for (n, leases) in held.iter_mut().enumerate() {
        for k in 0..BATCH {
            let id = format!("h{n}-{k}");
            let node = format!("n{n}");
            ledger
                .reserve_on(new_lease(id.clone()), &node, ROOM, 0)
                .await?;
            ledger.bind(&id, 1, &node, 0).await?;
            ledger.advance(&id, 1, &node, Phase::Launching, 0).await?;
            leases.push((id, 1));
        }
    }
    let held = Arc::new(held);
    for in_flight in [1, IN_FLIGHT] {
        let l = Arc::clone(&ledger);
        let held = Arc::clone(&held);
        figures.push(
            rate(ops, in_flight, move |i| {
                let l = Arc::clone(&l);
                let held = Arc::clone(&held);
                async move {
                    let n = i % NODES;
                    let (id, epoch) = &held[n][(i / NODES) % BATCH];
                    l.heartbeat(id, *epoch, &format!("n{n}"), 1 + i as i64)
                        .await?;
                    Ok(())
                }
            })
            .await?,
        );
    }
    for in_flight in [1, NODES] {
        let l = Arc::clone(&ledger);
        let held = Arc::clone(&held);
        let calls = (ops / BATCH).max(in_flight);
        let per_call = rate(calls, in_flight, move |i| {
            let l = Arc::clone(&l);
            let held = Arc::clone(&held);
            async move {
                let n = i % NODES;
                let results = l
                    .heartbeat_all(&held[n], &format!("n{n}"), 1 + i as i64)
                    .await?;
                anyhow::ensure!(results.iter().all(Result::is_ok), "a renewal was refused");
                Ok(())
            }
        })
        .await?;
        figures.push(per_call * BATCH as f64);
    }
    ledger.close().await;
    eprintln!("ledger bench: {backend} done");
    Ok(figures)
}

const FIGURES: &[&str] = &[
    "reservations/s, 1 in flight",
    "reservations/s, 16 in flight",
    "heartbeats/s, 1 in flight",
    "heartbeats/s, 16 in flight",
    "leases renewed/s, batches of 50, 1 in flight",
    "leases renewed/s, batches of 50, 4 in flight (one per node)",
];

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; nothing else is taken.
    let ops: usize = std::env::var("BILLET_BENCH_LEDGER_OPS")
        .ok()
        .map(|v| v.parse())
        .transpose()
        .context("BILLET_BENCH_LEDGER_OPS must be a count")?
        .unwrap_or(1000);

    let file = std::env::temp_dir().join(format!(
        "billet-ledger-bench-{}.db",
        uuid::Uuid::new_v4().simple()
    ));
    let sqlite = measure(&LedgerLocation::Sqlite(file.clone()), ops).await;
    for suffix in ["", "-wal", "-shm"] {
        let mut path = file.clone().into_os_string();
        path.push(suffix);
        let _ = std::fs::remove_file(path);
    }
    let sqlite = sqlite?;

    let scratch = ScratchPostgres::create()
        .await
        .map_err(anyhow::Error::msg)?;
    let postgres = measure(scratch.location(), ops).await;
    scratch.drop_database().await.map_err(anyhow::Error::msg)?;
    let postgres = postgres?;

    println!();
    println!(
        "ledger throughput, {ops} calls per figure ({} and {})",
        Backend::Sqlite,
        Backend::Postgres
    );
    println!(
        "| figure | SQLite (WAL, synchronous=FULL) | PostgreSQL (local socket) | PostgreSQL / SQLite |"
    );
    println!("|---|---|---|---|");
    for ((name, s), p) in FIGURES.iter().zip(&sqlite).zip(&postgres) {
        println!("| {name} | {s:.0} | {p:.0} | {:.2} |", p / s);
    }
    Ok(())
}
