//! A sink whose faults a test scripts, per record id and per attempt, after supabase/etl's test
//! destination: reject a record, fail after the write, hold a response, delay it; and fail a
//! lifecycle call (activate, begin, commit). A test awaits [`ScriptedSink::reached`] instead of
//! sleeping. Outcomes are scripted as the stage sees them (a permanent refusal, a transient
//! failure), not as a client library's codes. What reached
//! "Kafka" is kept, in order, so a test can check loss, duplicates and order.
//!
//! Invariants (those of [`Sink`], kept as a real sink keeps them):
//! - every record handed over gets exactly one report, under a number that only grows;
//! - a record is in [`ScriptedSink::written`] when the broker would hold it: acknowledged,
//!   held, delayed, or failed after the write; a rejected one (at once or once held) is not;
//! - a record without a scripted fault is acknowledged at once.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{MutexGuard, mpsc};

use super::{PublishError, Report, Reports, SendFailure, Sink, Written};
use crate::observe::metrics::ErrorType;
use crate::record::KafkaRecord;

/// What happens to one attempt at sending a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The broker refuses the record for good (message too large): nothing is written.
    Reject,
    /// The record is written, but its report is a transient failure (a lost acknowledgement):
    /// sending it again writes a duplicate.
    FailAfterWrite,
    /// The record is written; its report waits for [`ScriptedSink::release`] (acknowledged)
    /// or [`ScriptedSink::reject_held`] (refused after all: then it was not written).
    Hold,
    /// The record is written and acknowledged this much later.
    Delay(Duration),
}

/// A lifecycle call of the sink a test can make fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Lifecycle {
    /// Becoming the source's one producer (a transactional sink fences the ones before it).
    Activate,
    /// Beginning a Kafka transaction.
    Begin,
    /// Committing it.
    Commit,
}

pub(crate) struct ScriptedSink {
    /// Lifecycle calls to fail, and how many times each still fails.
    lifecycle_faults: Mutex<HashMap<Lifecycle, usize>>,
    /// Records handed over so far (every attempt), for [`ScriptedSink::reached`].
    handed_over: tokio::sync::watch::Sender<usize>,
    /// The faults of the next attempts at each id, first attempt first.
    faults: Mutex<HashMap<String, VecDeque<Fault>>>,
    /// Ids in the order they were handed over (every attempt).
    sent: Mutex<Vec<String>>,
    /// The records handed over, in order (every attempt).
    records: Mutex<Vec<KafkaRecord>>,
    /// Ids in the order the broker wrote them.
    written: Mutex<Vec<String>>,
    /// Numbers and ids of held records, waiting for [`ScriptedSink::release`].
    held: Mutex<Vec<(usize, String)>>,
    reports: tokio::sync::Mutex<Reports>,
    sender: mpsc::UnboundedSender<Report>,
    next_seq: AtomicUsize,
    sources: Vec<Arc<str>>,
    /// Kafka transactions: written ids are visible to `read_committed` readers once committed.
    transactional: bool,
    /// A transaction is open.
    open: std::sync::atomic::AtomicBool,
    /// What each commit made visible, in order.
    commits: Mutex<Vec<Vec<String>>>,
    /// How many of `written` the commits made visible so far.
    visible: AtomicUsize,
    /// How often the sink was made fresh ([`Sink::recover`]), and whether it was flushed.
    recoveries: AtomicUsize,
    flushed: std::sync::atomic::AtomicBool,
    /// What read-backs left for the next activation (a scripted one unpins nothing).
    pinned: crate::sink::Pinned,
}

impl ScriptedSink {
    pub(crate) fn new() -> ScriptedSink {
        let (sender, reports) = mpsc::unbounded_channel();
        ScriptedSink {
            lifecycle_faults: Mutex::default(),
            handed_over: tokio::sync::watch::channel(0).0,
            faults: Mutex::default(),
            sent: Mutex::default(),
            records: Mutex::default(),
            written: Mutex::default(),
            held: Mutex::default(),
            reports: tokio::sync::Mutex::new(reports),
            sender,
            next_seq: AtomicUsize::new(0),
            sources: Vec::new(),
            transactional: false,
            open: std::sync::atomic::AtomicBool::new(false),
            commits: Mutex::default(),
            visible: AtomicUsize::new(0),
            recoveries: AtomicUsize::new(0),
            flushed: std::sync::atomic::AtomicBool::new(false),
            pinned: Default::default(),
        }
    }

    /// How often the sink was made fresh after a failed session.
    pub(crate) fn recoveries(&self) -> usize {
        self.recoveries.load(Ordering::SeqCst)
    }

    /// Whether the sink was flushed (at shutdown).
    pub(crate) fn flushed(&self) -> bool {
        self.flushed.load(Ordering::SeqCst)
    }

    /// A sink that writes in Kafka transactions.
    pub(crate) fn transactional() -> ScriptedSink {
        ScriptedSink { transactional: true, ..ScriptedSink::new() }
    }

    /// The open transaction is abandoned (its session ended; a fresh producer aborts it): what it
    /// wrote never becomes visible.
    pub(crate) fn abandon(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.visible.store(self.written.lock().unwrap().len(), Ordering::SeqCst);
    }

    /// What each commit made visible to `read_committed` readers, commit by commit.
    pub(crate) fn commits(&self) -> Vec<Vec<String>> {
        self.commits.lock().unwrap().clone()
    }

    /// The next attempts at record `id` meet `faults`, in order; later ones succeed.
    pub(crate) fn script(&self, id: &str, faults: impl IntoIterator<Item = Fault>) {
        self.faults.lock().unwrap().entry(id.to_string()).or_default().extend(faults);
    }

    /// The next `times` calls of `call` fail (a broker that refuses, a transaction coordinator
    /// that times out).
    pub(crate) fn fail(&self, call: Lifecycle, times: usize) {
        *self.lifecycle_faults.lock().unwrap().entry(call).or_default() += times;
    }

    /// Resolves once `records` records were handed over in all (every attempt counts): a test
    /// awaits this instead of sleeping.
    pub(crate) async fn reached(&self, records: usize) {
        let mut handed_over = self.handed_over.subscribe();
        handed_over.wait_for(|n| *n >= records).await.expect("the sink lives");
    }

    /// The scripted failure of `call`, if one is left.
    fn lifecycle(&self, call: Lifecycle) -> Result<(), crate::error::RelayError> {
        let mut faults = self.lifecycle_faults.lock().unwrap();
        match faults.get_mut(&call) {
            Some(left) if *left > 0 => {
                *left -= 1;
                Err(crate::error::RelayError::Kafka(format!("scripted: {call:?} failed")))
            }
            _ => Ok(()),
        }
    }

    /// Acknowledges every held record, in the order they were sent.
    pub(crate) fn release(&self) {
        for (seq, _) in self.held.lock().unwrap().drain(..) {
            let _ =
                self.sender.send(Report { seq, outcome: Ok(Written { partition: 0, offset: seq as i64 }) });
        }
    }

    /// Refuses every held record for good (after records sent behind them were reported).
    pub(crate) fn reject_held(&self) {
        for (seq, id) in self.held.lock().unwrap().drain(..) {
            self.written.lock().unwrap().retain(|written| *written != id);
            let _ = self.sender.send(refused(seq));
        }
    }

    /// Every id handed over, each attempt, in order.
    pub(crate) fn sent(&self) -> Vec<String> {
        self.sent.lock().unwrap().clone()
    }

    /// Every record handed over, each attempt, in order.
    pub(crate) fn records(&self) -> Vec<KafkaRecord> {
        self.records.lock().unwrap().clone()
    }

    /// The ids the broker holds, in the order it wrote them.
    pub(crate) fn written(&self) -> Vec<String> {
        self.written.lock().unwrap().clone()
    }
}

impl Sink for ScriptedSink {
    async fn enqueue(&self, record: &KafkaRecord) -> usize {
        assert!(
            !self.transactional || self.open.load(Ordering::SeqCst),
            "record {} handed over outside a transaction",
            record.id
        );
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        self.sent.lock().unwrap().push(record.id.clone());
        self.handed_over.send_modify(|n| *n += 1);
        self.records.lock().unwrap().push(record.clone());
        let fault = self.faults.lock().unwrap().get_mut(&record.id).and_then(VecDeque::pop_front);
        if fault != Some(Fault::Reject) {
            self.written.lock().unwrap().push(record.id.clone());
        }
        let report = match fault {
            None => Report { seq, outcome: Ok(Written { partition: 0, offset: seq as i64 }) },
            Some(Fault::Reject) => refused(seq),
            Some(Fault::FailAfterWrite) => lost(seq),
            Some(Fault::Hold) => {
                self.held.lock().unwrap().push((seq, record.id.clone()));
                return seq;
            }
            Some(Fault::Delay(delay)) => {
                let sender = self.sender.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = sender
                        .send(Report { seq, outcome: Ok(Written { partition: 0, offset: seq as i64 }) });
                });
                return seq;
            }
        };
        let _ = self.sender.send(report);
        seq
    }

    async fn reports(&self) -> MutexGuard<'_, Reports> {
        self.reports.lock().await
    }

    /// The outcome scripted ([`refused`], [`lost`]).
    async fn classify(&self, _record: &KafkaRecord, failure: &SendFailure) -> PublishError {
        failure.classified()
    }

    fn set_sources(&mut self, sources: &[String]) {
        self.sources = sources.iter().map(|s| Arc::from(s.as_str())).collect();
    }

    fn sources(&self) -> &[Arc<str>] {
        &self.sources
    }

    /// Nothing of a failed session outlives it here: nothing to wait for, nothing to renew.
    async fn retired(&mut self, _limit: Duration) {}

    /// A fresh producer, as the Kafka sink's: a transaction the failed one left open is
    /// aborted (see [`ScriptedSink::abandon`]).
    fn recover(&mut self) {
        self.recoveries.fetch_add(1, Ordering::SeqCst);
        self.abandon();
    }

    async fn flush(&self) {
        self.flushed.store(true, Ordering::SeqCst);
    }

    fn transactional(&self) -> bool {
        self.transactional
    }

    async fn activate(&mut self) -> Result<(), crate::error::RelayError> {
        self.lifecycle(Lifecycle::Activate)
    }

    fn begin(&self) -> Result<(), crate::error::RelayError> {
        self.lifecycle(Lifecycle::Begin)?;
        assert!(!self.open.swap(true, Ordering::SeqCst), "a transaction begun twice");
        Ok(())
    }

    async fn commit(&self) -> Result<(), crate::error::RelayError> {
        self.lifecycle(Lifecycle::Commit)?;
        assert!(self.open.swap(false, Ordering::SeqCst), "a commit without a transaction");
        assert!(self.held.lock().unwrap().is_empty(), "a commit with records unreported");
        let written = self.written.lock().unwrap();
        let from = self.visible.swap(written.len(), Ordering::SeqCst);
        self.commits.lock().unwrap().push(written[from..].to_vec());
        Ok(())
    }

    fn fenced(&self) -> Option<crate::error::RelayError> {
        None
    }

    fn pinned(&self) -> crate::sink::Pinned {
        self.pinned.clone()
    }
}

/// The report of record `seq` refused for good (as a record too large is).
fn refused(seq: usize) -> Report {
    let failure = PublishError::Permanent("the broker refuses the record: message size too large".into());
    Report { seq, outcome: Err(SendFailure::scripted(failure)) }
}

/// The report of record `seq` written but not acknowledged (a request that timed out).
fn lost(seq: usize) -> Report {
    let detail = "no acknowledgement: request timed out".into();
    Report {
        seq,
        outcome: Err(SendFailure::scripted(PublishError::Transient {
            error_type: ErrorType::Timeout,
            detail,
        })),
    }
}

/// A record with id `id` for topic `t`, keyed `k`.
pub(crate) fn record(id: &str) -> KafkaRecord {
    KafkaRecord {
        id: id.to_string(),
        topic: "t".into(),
        key: "k".into(),
        payload: id.as_bytes().to_vec(),
        event_type: "e".into(),
        aggregate_type: "a".into(),
        row_headers: Vec::new(),
        row_columns: Vec::new(),
        created_at: None,
        position: None,
        outbox: crate::config::OutboxId::default(),
        formatted: None,
        as_written: None,
        trace: None,
    }
}
