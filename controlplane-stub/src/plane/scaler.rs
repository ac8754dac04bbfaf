//! The scale-set listener: its session with GitHub, restarted with backoff
//! and moved to the set's new id when the set is made again, and the
//! [`Scaler`] that turns its messages into wanted jobs, durable in the ledger
//! before a message is acknowledged.

use std::sync::Arc;
use std::time::Duration;

use scaleset::JobMessage;
use scaleset::listener::{Event, Listener, Scaler};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::ledger::WantedChange;

use super::coverage::RELAUNCH_MAX_DELAY;
use super::{Plane, PlaneEvent, restart_backoff};

pub(super) enum Work {
    Complete { runner_name: String, result: String },
}

impl Plane {
    /// Runs the scale-set listener, restarting it with backoff. A listener
    /// that fails because GitHub no longer has the set marks it missing and
    /// waits for the set to be found again (one lookup per retry interval),
    /// then listens on the set's current id.
    pub(super) async fn listen(
        self: Arc<Self>,
        work: mpsc::UnboundedSender<Work>,
        shutdown: CancellationToken,
    ) {
        let mut scaler = PlaneScaler {
            plane: Arc::clone(&self),
            work,
        };
        let label = self.config.tier.label.clone();
        let mut backoff = restart_backoff();
        loop {
            let set = self.scale_set();
            // No retries inside: every failure comes back here, where a
            // missing set is told apart from an outage.
            let listener =
                Listener::new(self.github.client().clone(), set, self.config.max_runners)
                    .owner("billet-plane")
                    .max_failures(0);
            let wait = match listener
                .run(&mut scaler, shutdown.clone().cancelled_owned())
                .await
            {
                Ok(()) => return,
                Err(scaleset::listener::Error::Session(e)) if e.is_not_found() => {
                    self.github.mark_missing(&label);
                    None
                }
                Err(e) => {
                    warn!(error = %e, "scale-set listener stopped; restarting");
                    Some(backoff.next().unwrap_or(RELAUNCH_MAX_DELAY))
                }
            };
            match wait {
                Some(wait) => {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                None => loop {
                    match self.github.scale_set(&label).await {
                        Ok(id) => {
                            let old = std::mem::replace(
                                &mut *self.scale_set.lock().expect("scale set"),
                                id,
                            );
                            if old != id {
                                // A set made again is a new set: GitHub
                                // dropped the old one's jobs with it, so
                                // they are not covered any more; the new
                                // set's session assigns its own.
                                let dropped = {
                                    let mut cover = self.cover.lock().expect("cover");
                                    cover.recovered.clear();
                                    cover.excess_seen = None;
                                    std::mem::take(&mut cover.wanted)
                                };
                                info!(scale_set = %label, old = %old, new = %id, dropped = dropped.len(),
                                      "the runner scale set was made again; listening on its new id");
                                // Best effort: a plane started later drops
                                // them too.
                                if let Err(e) =
                                    self.ledger.forget_other_scale_sets(&label, id.get()).await
                                {
                                    warn!(error = %e, "forgetting the old set's wanted jobs");
                                }
                            }
                            backoff = restart_backoff();
                            break;
                        }
                        Err(e) => {
                            if !e.is_scale_set_not_found() {
                                warn!(error = %e, "looking the scale set up");
                            }
                            tokio::select! {
                                () = shutdown.cancelled() => return,
                                () = tokio::time::sleep(self.config.scale_set_retry.min(Duration::from_secs(1))) => {}
                            }
                        }
                    }
                },
            }
        }
    }

    pub(super) async fn work(
        self: Arc<Self>,
        mut rx: mpsc::UnboundedReceiver<Work>,
        shutdown: CancellationToken,
    ) {
        loop {
            let item = tokio::select! {
                () = shutdown.cancelled() => return,
                w = rx.recv() => match w { Some(w) => w, None => return },
            };
            let plane = Arc::clone(&self);
            match item {
                Work::Complete {
                    runner_name,
                    result,
                } => {
                    let span = info_span!("complete", runner = %runner_name);
                    let shutdown = shutdown.clone();
                    self.tasks.spawn(
                        async move { plane.complete(runner_name, result, shutdown).await }
                            .instrument(span),
                    );
                }
            }
        }
    }
}

/// Feeds listener events to the plane: an assigned job becomes wanted (and
/// the coverage pass that reserves its lease runs before the message is
/// acknowledged); a started job is taken, and its runner covers nothing
/// more; a completed or cancelled job is no longer wanted. What a message
/// changes in the wanted jobs is written to the ledger before anything
/// else, so it is durable before the message is acknowledged; a poll that
/// ends with no message lets the plane drop recovered jobs GitHub no
/// longer counts (`Cover::quiet_poll`).
struct PlaneScaler {
    plane: Arc<Plane>,
    work: mpsc::UnboundedSender<Work>,
}

impl Scaler for PlaneScaler {
    type Error = crate::ledger::LedgerError;

    async fn scale(&mut self, event: Event<'_>) -> Result<(), Self::Error> {
        let Some(message) = event.message() else {
            if matches!(event, Event::Idle { .. }) {
                self.quiet_poll(event.statistics()).await;
            }
            return Ok(());
        };
        let plane = &self.plane;
        let changes: Vec<WantedChange> = message
            .jobs
            .iter()
            .filter_map(|job| match job {
                JobMessage::Assigned(job) => {
                    Some(WantedChange::Assigned(job.job.runner_request_id.get()))
                }
                JobMessage::Started(job) => {
                    Some(WantedChange::Gone(job.job.runner_request_id.get()))
                }
                JobMessage::Completed(job) => {
                    Some(WantedChange::Gone(job.job.runner_request_id.get()))
                }
                _ => None,
            })
            .collect();
        // An error leaves the message unacknowledged: GitHub delivers it
        // again, and every step below is safe to repeat.
        plane
            .ledger
            .record_wanted(
                &plane.config.tier.label,
                plane.scale_set().get(),
                &changes,
                crate::now_ms(),
            )
            .await?;
        plane.cover.lock().expect("cover").message_seen();
        plane.note_messages(&message.jobs).await;
        let mut assigned = false;
        for job in &message.jobs {
            match job {
                JobMessage::Assigned(job) => {
                    let request_id = job.job.runner_request_id.get();
                    let mut cover = plane.cover.lock().expect("cover");
                    // Delivered again: GitHub still has it.
                    cover.recovered.retain(|r| *r != request_id);
                    assigned |= cover.wanted.insert(request_id);
                }
                JobMessage::Started(job) => {
                    let request_id = job.job.runner_request_id.get();
                    {
                        let mut cover = plane.cover.lock().expect("cover");
                        cover.forget(request_id);
                        cover.taken.insert(job.runner_name.clone());
                        cover.succeeded();
                    }
                    plane.emit(PlaneEvent::Started {
                        request_id,
                        runner_name: job.runner_name.clone(),
                    });
                }
                JobMessage::Completed(job) => {
                    let request_id = job.job.runner_request_id.get();
                    {
                        let mut cover = plane.cover.lock().expect("cover");
                        cover.forget(request_id);
                        cover.completed.insert(job.runner_name.clone());
                    }
                    plane.emit(PlaneEvent::Completed {
                        request_id,
                        runner_name: job.runner_name.clone(),
                        result: job.result.clone(),
                    });
                    if !job.runner_name.is_empty() {
                        let _ = self.work.send(Work::Complete {
                            runner_name: job.runner_name.clone(),
                            result: job.result.clone(),
                        });
                    }
                }
                _ => {}
            }
        }
        if assigned {
            Arc::clone(plane).cover_once().await?;
        }
        plane.wake.notify_one();
        Ok(())
    }
}

impl PlaneScaler {
    /// A poll ended with no message, with GitHub's `statistics`: recovered
    /// jobs GitHub no longer counts are dropped (`Cover::quiet_poll`), in
    /// memory and then in the ledger. A failed ledger write is only
    /// logged: a plane started later recovers those jobs and judges them
    /// again.
    async fn quiet_poll(&self, statistics: &scaleset::ScaleSetStatistics) {
        let plane = &self.plane;
        let waiting = statistics
            .total_assigned_jobs
            .saturating_sub(statistics.total_running_jobs);
        let gone = plane
            .cover
            .lock()
            .expect("cover")
            .quiet_poll(usize::try_from(waiting).unwrap_or(usize::MAX));
        if gone.is_empty() {
            return;
        }
        info!(jobs = ?gone, waiting,
              "GitHub no longer counts these recovered jobs (they ended while no plane listened); not covering them");
        let changes: Vec<WantedChange> = gone.into_iter().map(WantedChange::Gone).collect();
        if let Err(e) = plane
            .ledger
            .record_wanted(
                &plane.config.tier.label,
                plane.scale_set().get(),
                &changes,
                crate::now_ms(),
            )
            .await
        {
            warn!(error = %e, "forgetting recovered jobs GitHub no longer counts");
        }
    }
}
