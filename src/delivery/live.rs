//! Work the active session carries out beside its stream: a republish or a dead-letter replay
//! asked for through the admin API or the signal table, sent through the session's own stage
//! and sink, between the stream's records.
//!
//! The protocol, between a requester ([`Leader`]) and the active session ([`Desk`], [`Turn`]):
//! 1. the requester asks ([`Leader::quiet`]); the session stops reading new input (as paused),
//!    lets what it handed to Kafka settle, commits an open Kafka transaction, and says it is
//!    quiet: every record of the stream sent so far is acknowledged (and committed);
//! 2. the requester reads what it will send (it may read Kafka: the stream's records are there)
//!    and hands the records over ([`Quiet::send`]); the session sends them aside from its
//!    positions ([`Delivery::send_aside`]), waits for each report (with Kafka transactions, the
//!    commit), answers what became of each, and reads on. A requester that gives up (drops its
//!    [`Quiet`]) lets the session read on at once.
//!
//! Invariants:
//! - while a request is being served the session reads nothing new, so every record of it lands
//!   in its partition after every record of the stream the requester could read, and before
//!   every record the stream sends after it;
//! - an aside record settles no position: nothing the source confirms or releases depends on
//!   it, and it is never held or dead-lettered (a refusal is its answer);
//! - one request at a time per process; a request reaches only the session that is active (a
//!   standby never takes one), and one the session cannot serve (it ends first) answers
//!   nothing: the requester says the session ended.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, MutexGuard, mpsc, oneshot};

use super::Delivery;
use super::once::Delivered;
use crate::error::RelayError;
use crate::record::KafkaRecord;
use crate::sink::Sink;

/// A request as the session takes it.
struct Request {
    quiet: oneshot::Sender<Quiet>,
}

/// The session is quiet: hand it the records to send, or drop this to let it read on.
pub(crate) struct Quiet {
    records: oneshot::Sender<Vec<KafkaRecord>>,
    outcomes: oneshot::Receiver<Vec<Delivered>>,
}

/// Why a request was not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unserved {
    /// No active session took it within the wait: why it may be.
    NotQuiet(String),
    /// The session ended before it answered (a crash, a lost connection, a lost leadership).
    SessionEnded,
}

impl std::fmt::Display for Unserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unserved::NotQuiet(why) => f.write_str(why),
            Unserved::SessionEnded => f.write_str(
                "the relay's session ended before it answered (a lost connection or leadership): nothing more of it \
                 is sent; ask again once the relay is active",
            ),
        }
    }
}

/// The requester's side: the admin API and the signal table hold clones.
#[derive(Clone)]
pub(crate) struct Leader {
    requests: mpsc::Sender<Request>,
}

/// The sources' side: one session at a time takes requests from it.
#[derive(Clone)]
pub(crate) struct Desk {
    requests: Arc<Mutex<mpsc::Receiver<Request>>>,
}

/// The two sides of one process's requests.
pub(crate) fn channel() -> (Leader, Desk) {
    let (tx, rx) = mpsc::channel(1);
    (Leader { requests: tx }, Desk { requests: Arc::new(Mutex::new(rx)) })
}

impl Default for Desk {
    /// A desk nobody asks (one-shot commands, tests).
    fn default() -> Desk {
        channel().1
    }
}

impl Leader {
    /// Waits, at most `wait`, until the active session is quiet (see the module doc).
    pub(crate) async fn quiet(&self, wait: Duration) -> Result<Quiet, Unserved> {
        let (tx, rx) = oneshot::channel();
        let not_quiet = || {
            Unserved::NotQuiet(format!(
                "the active session did not stop within {} s: it may be holding at an unpublishable event, waiting \
                 for Kafka, or restarting (see /readyz); ask again",
                wait.as_secs()
            ))
        };
        let asked = async {
            self.requests.send(Request { quiet: tx }).await.map_err(|_| Unserved::SessionEnded)?;
            rx.await.map_err(|_| Unserved::SessionEnded)
        };
        tokio::time::timeout(wait, asked).await.map_err(|_| not_quiet())?
    }
}

impl Quiet {
    /// Sends `records` through the session, in this order, and waits for what became of each
    /// (at most `limit`: then the rest are unacknowledged).
    pub(crate) async fn send(
        self,
        records: Vec<KafkaRecord>,
        limit: Duration,
    ) -> Result<Vec<Delivered>, Unserved> {
        let count = records.len();
        self.records.send(records).map_err(|_| Unserved::SessionEnded)?;
        match tokio::time::timeout(limit, self.outcomes).await {
            Ok(Ok(outcomes)) => Ok(outcomes),
            Ok(Err(_)) => Err(Unserved::SessionEnded),
            Err(_) => Ok(vec![
                Delivered::Unacknowledged(format!(
                    "no answer from Kafka within {} s",
                    limit.as_secs()
                ));
                count
            ]),
        }
    }
}

/// Where a session is with the request it serves.
enum State {
    Idle,
    /// Asked: stop reading, settle, then say so.
    Quieting(oneshot::Sender<Quiet>),
    /// Quiet: waiting for the records.
    Waiting {
        records: oneshot::Receiver<Vec<KafkaRecord>>,
        outcomes: oneshot::Sender<Vec<Delivered>>,
    },
    /// The records are in flight: their outcomes so far, by their place.
    Sending {
        outcomes: oneshot::Sender<Vec<Delivered>>,
        done: Vec<Option<Delivered>>,
    },
}

/// One session's part of the desk: it takes requests while it lives.
pub(crate) struct Turn<'a> {
    requests: MutexGuard<'a, mpsc::Receiver<Request>>,
    state: State,
}

/// What [`Turn::wake`] found.
pub(crate) enum Woken {
    /// A request came, or the requester gave up: look at [`Turn::reading`] again.
    Changed,
    /// The records to send now ([`Turn::send`]).
    Records(Vec<KafkaRecord>),
}

impl Desk {
    /// The session's turn at the desk (sessions of one process follow each other).
    pub(crate) async fn turn(&self) -> Turn<'_> {
        Turn { requests: self.requests.lock().await, state: State::Idle }
    }
}

impl Turn<'_> {
    /// Whether the session may read new input: no request is being served.
    pub(crate) fn reading(&self) -> bool {
        matches!(self.state, State::Idle)
    }

    /// Whether a request waits for the session to become quiet.
    pub(crate) fn quieting(&self) -> bool {
        matches!(self.state, State::Quieting(_))
    }

    /// Resolves when a request comes, its records come, or its requester gives up; never
    /// otherwise. Cancel-safe (for a `select!` beside the session's input).
    pub(crate) async fn wake(&mut self) -> Woken {
        match &mut self.state {
            State::Idle => match self.requests.recv().await {
                Some(request) => {
                    self.state = State::Quieting(request.quiet);
                    Woken::Changed
                }
                None => std::future::pending().await,
            },
            State::Waiting { records, .. } => match records.await {
                Ok(records) => Woken::Records(records),
                Err(_) => {
                    self.state = State::Idle;
                    Woken::Changed
                }
            },
            State::Quieting(quiet) => {
                quiet.closed().await;
                self.state = State::Idle;
                Woken::Changed
            }
            State::Sending { .. } => std::future::pending().await,
        }
    }

    /// Moves the request on as far as `delivery` allows: says quiet once nothing of the
    /// stream is in flight or in an open Kafka transaction (the source commits that first);
    /// answers once every aside record is done (committing their Kafka transaction).
    pub(crate) async fn advance<S: Sink, P: Clone>(
        &mut self,
        delivery: &mut Delivery<'_, S, P>,
    ) -> Result<(), RelayError> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Quieting(quiet) if delivery.records() == 0 && !delivery.in_transaction() => {
                let (records_tx, records) = oneshot::channel();
                let (outcomes, outcomes_rx) = oneshot::channel();
                if quiet.send(Quiet { records: records_tx, outcomes: outcomes_rx }).is_ok() {
                    tracing::info!(
                        "quiet: reading stopped for a request of the admin API or the signal table"
                    );
                    self.state = State::Waiting { records, outcomes };
                }
            }
            State::Sending { outcomes, mut done } => {
                for (key, delivered) in delivery.take_aside() {
                    done[key] = Some(delivered);
                }
                if delivery.aside_in_flight() == 0 && delivery.in_transaction() {
                    let settled = delivery.commit(&crate::observe::metrics::Clock::now()).await?;
                    debug_assert!(settled.is_empty(), "a quiet session's transaction held its own records");
                    for (key, delivered) in delivery.take_aside() {
                        done[key] = Some(delivered);
                    }
                }
                if done.iter().all(Option::is_some) {
                    let _ = outcomes.send(done.into_iter().map(Option::unwrap).collect());
                    tracing::info!("the request was served: reading on");
                } else {
                    self.state = State::Sending { outcomes, done };
                }
            }
            other => self.state = other,
        }
        Ok(())
    }

    /// Hands the request's `records` to `delivery`, in order (see [`Delivery::send_aside`]).
    pub(crate) async fn send<S: Sink, P: Clone>(
        &mut self,
        delivery: &mut Delivery<'_, S, P>,
        records: Vec<KafkaRecord>,
    ) -> Result<(), RelayError> {
        let State::Waiting { outcomes, .. } = std::mem::replace(&mut self.state, State::Idle) else {
            return Ok(());
        };
        let mut done = vec![None; records.len()];
        let mut topics: Vec<String> = records.iter().map(|r| r.topic.clone()).collect();
        topics.sort();
        topics.dedup();
        delivery.refresh_topics(&topics).await;
        for (key, record) in records.into_iter().enumerate() {
            if let Err(e) = delivery.send_aside(key, record).await {
                done[key] = Some(Delivered::Unacknowledged(e.to_string()));
                // (a Kafka transaction that cannot begin ends the session: the rest are not sent)
                self.state = State::Sending { outcomes, done };
                return Err(e);
            }
        }
        self.state = State::Sending { outcomes, done };
        self.advance(delivery).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::delivery::Settled;
    use crate::delivery::fixture::Fixture;
    use crate::sink::scripted::record;

    /// A session's loop over `delivery` with one stream record in flight (position 1) when a
    /// request for `aside` comes: the positions it settled, whether the stream's record had
    /// settled when the session said it was quiet, and the request's outcomes.
    async fn serve(f: &Fixture, aside: Vec<KafkaRecord>) -> (Vec<u32>, bool, Vec<Delivered>) {
        let mut delivery = f.delivery::<u32>().await;
        let (leader, desk) = channel();
        let mut turn = desk.turn().await;
        assert!(delivery.send(1, record("1"), Instant::now()).await.unwrap().is_none());
        let asking = tokio::spawn(async move {
            let quiet = leader.quiet(Duration::from_secs(5)).await.unwrap();
            quiet.send(aside, Duration::from_secs(5)).await.unwrap()
        });
        let (mut settled, mut settled_when_quiet, mut served) = (Vec::new(), None, false);
        let looping = async {
            loop {
                if delivery.commit_due(true) && delivery.records() == 0 && turn.reading() {
                    // (the stream commits its Kafka transaction where it may: here, idle)
                    for s in delivery.commit(&crate::observe::metrics::Clock::now()).await.unwrap() {
                        settled.push(s);
                    }
                }
                if turn.quieting() && delivery.records() == 0 {
                    for s in delivery.commit(&crate::observe::metrics::Clock::now()).await.unwrap() {
                        settled.push(s);
                    }
                }
                turn.advance(&mut delivery).await.unwrap();
                if served && turn.reading() {
                    return;
                }
                let waiting = delivery.records() + delivery.aside_waiting();
                tokio::select! {
                    woken = turn.wake() => if let Woken::Records(records) = woken {
                        settled_when_quiet = Some(settled.iter().any(|s| matches!(s, Settled::Acked(1))));
                        served = true;
                        turn.send(&mut delivery, records).await.unwrap();
                    },
                    next = delivery.next(), if waiting > 0 => if let Some(s) = next.unwrap() { settled.push(s) },
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(5), looping).await.expect("the request was served");
        let positions =
            settled.iter().filter_map(|s| if let Settled::Acked(p) = s { Some(*p) } else { None });
        (positions.collect(), settled_when_quiet.unwrap(), asking.await.unwrap())
    }

    #[tokio::test]
    async fn a_request_is_sent_once_the_stream_settled_and_settles_no_position() {
        let f = Fixture::new("dead_letter");
        let (positions, settled_first, outcomes) = serve(&f, vec![record("a"), record("b")]).await;
        assert!(settled_first, "quiet only once the stream's record was acknowledged");
        assert_eq!(positions, [1], "the request's records settle no position");
        assert_eq!(outcomes, [Delivered::Acked, Delivered::Acked]);
    }

    #[tokio::test]
    async fn with_kafka_transactions_the_stream_commits_first_and_the_request_is_acked_at_its_own_commit() {
        let f = Fixture::transactional("dead_letter");
        let (positions, settled_first, outcomes) = serve(&f, vec![record("a"), record("b")]).await;
        assert!(settled_first, "the stream's transaction committed before the session said quiet");
        assert_eq!(positions, [1]);
        assert_eq!(outcomes, [Delivered::Acked, Delivered::Acked], "acknowledged and committed");
    }
}
