//! The loop: take a record, apply it (retrying what may pass later), or dead-letter it, then
//! commit its offset.
//!
//! Invariants:
//! - **an offset is committed only after the record's database transaction committed** (or,
//!   for a dead letter, after the broker acknowledged the dead letter and its `dead_lettered`
//!   row committed): offset + 1 is stored (`enable.auto.offset.store = false`) and committed
//!   right after. A crash before the commit redelivers the record, and the inbox turns the
//!   redelivery into a no-op: effects happen once, delivery is at-least-once;
//! - commits are asynchronous, with a synchronous one at shutdown. That is safe because an
//!   offset is stored only once its record is applied, so no commit, whatever its order or
//!   fate, can ever name a record that is not applied; a commit that is lost or overtaken only
//!   means more redeliveries, which the inbox skips. Waiting for each commit would cost a broker
//!   round trip per record and buy nothing;
//! - a record is never skipped: it is applied, declined, found a duplicate, or dead-lettered;
//!   an unreachable database or broker is waited for without limit (logging each failure at
//!   warn), because every record would fail alike;
//! - no single record can stop or wedge the consumer: whatever one record's data makes the
//!   database refuse ends in a dead letter, and if even the `dead_lettered` inbox row is
//!   refused, the offset is committed anyway once the broker holds the dead letter (logged at
//!   error). Only a failure every record would share stops the process
//!   ([`LedgerError::Database`]);
//! - records are processed one at a time: a record in backoff holds back this instance's other
//!   partitions, for at most `max_attempts` backoffs of at most `max_backoff_ms` each. More
//!   throughput: more instances in the group (up to the partition count);
//! - on SIGTERM/SIGINT the record in hand is finished and committed, then the process exits 0;
//!   a record waiting in a backoff is left uncommitted and is redelivered after the restart;
//! - a database outage longer than librdkafka's `max.poll.interval.ms` (5 minutes) makes this
//!   instance leave the group (it is not polling); it rejoins once the database is back, and
//!   the records that moved to another instance meanwhile are skipped there as duplicates.

use std::time::{Duration, SystemTime};

use outbox_relay::observe::trace::{Begun, Kind, TRACEPARENT, Value, tracer};
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, ClientContext};
use tokio::sync::watch;
use tracing::{debug, error, info, warn};

use crate::apply::{DEAD_LETTERED, OpenError, Outcome, Seen, Session};
use crate::config::{DEFAULT_SESSION_TIMEOUT_MS, LedgerConfig};
use crate::dead_letter::DeadLetters;
use crate::error::LedgerError;
use crate::record::{Inbound, OrderPlaced, Sources, classify};
use crate::retry::{Backoff, Failure, contention_name, describe};

/// Logs rebalances and failed offset commits.
pub struct LedgerContext;

/// OAUTHBEARER tokens ([kafka.auth]) from the relay's one token source.
impl ClientContext for LedgerContext {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(
        &self,
        config: Option<&str>,
    ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
        outbox_relay::sink::kafka::oauth_token(config)
    }
}

impl ConsumerContext for LedgerContext {
    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(partitions) => {
                info!(partitions = %describe_partitions(partitions), "partitions assigned")
            }
            Rebalance::Revoke(partitions) => {
                info!(partitions = %describe_partitions(partitions), "partitions revoked")
            }
            Rebalance::Error(e) => warn!(error = %e, "rebalance failed"),
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        match result {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                // the records after the last committed offset are redelivered, then skipped
                warn!(error = %e, "offset commit failed")
            }
        }
    }
}

fn describe_partitions(partitions: &TopicPartitionList) -> String {
    let list: Vec<String> =
        partitions.elements().iter().map(|e| format!("{}[{}]", e.topic(), e.partition())).collect();
    list.join(",")
}

/// What became of a record.
enum Step {
    /// Applied, declined, a duplicate or dead-lettered: commit its offset.
    Done,
    /// Shutdown came during a wait: leave it uncommitted.
    Interrupted,
}

/// What a database operation came to once outages were waited out.
enum Attempt<T> {
    Done(T),
    Failed(tokio_postgres::Error),
    Interrupted,
}

/// How many records ended how, for the exit log line.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    debited: u64,
    declined: u64,
    duplicates: u64,
    dead_lettered: u64,
}

pub struct Ledger {
    config: LedgerConfig,
    consumer: StreamConsumer<LedgerContext>,
    dead_letters: DeadLetters,
    session: Option<Session>,
    /// Between reconnection attempts; reset by a working session.
    outage: Backoff,
    shutdown: watch::Receiver<bool>,
    tally: Tally,
    /// `consumer.sources`.
    sources: Sources,
    /// `consumer.registry`: values in the Confluent wire format decoded to JSON.
    decoder: Option<outbox_relay::record::registry::Decoder>,
}

impl Ledger {
    /// Connects (waiting for the database if it is not up yet), checks the tables, and
    /// subscribes.
    pub async fn start(
        config: LedgerConfig,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Option<Ledger>, LedgerError> {
        let backoff = config.consumer.backoff();
        let consumer = consumer(&config)?;
        let dead_letters = DeadLetters::new(&config.kafka, config.consumer.dead_letter_topic())?;
        let sources = Sources(config.consumer.sources.clone());
        if sources.0.is_empty() {
            warn!(
                "consumer.sources is empty: events of any outbox that publishes to the topic are applied; list yours"
            );
        }
        let decoder = decoder(&config.consumer.registry)?;
        let mut ledger = Ledger {
            decoder,
            sources,
            config,
            consumer,
            dead_letters,
            session: None,
            outage: backoff,
            shutdown,
            tally: Tally::default(),
        };
        if !ledger.connect().await? {
            return Ok(None);
        }
        let topic = ledger.config.consumer.topic.clone();
        ledger
            .consumer
            .subscribe(&[&topic])
            .map_err(|source| LedgerError::Kafka { what: format!("cannot subscribe to {topic}"), source })?;
        Ok(Some(ledger))
    }

    /// Runs until shutdown, or until an error no retry can fix.
    pub async fn run(mut self) -> Result<(), LedgerError> {
        let consumer = &self.config.consumer;
        info!(topic = %consumer.topic, group = %consumer.group_id, "consuming");
        while let Some(record) = self.next_record().await {
            let span = tracer().and_then(|t| t.begin(record.header(TRACEPARENT), SystemTime::now()));
            let before = self.tally;
            let step = self.handle(&record).await?;
            if let Some(span) = span {
                self.traced(&record, &span, before);
            }
            match step {
                Step::Done => self.commit(&record),
                Step::Interrupted => {
                    // uncommitted: redelivered after the restart
                    info!(record = %record.position(), "shutdown during a retry wait");
                    break;
                }
            }
        }
        self.commit_final();
        let t = &self.tally;
        info!(
            debited = t.debited,
            declined = t.declined,
            duplicates = t.duplicates,
            dead_lettered = t.dead_lettered,
            "stopped"
        );
        Ok(())
    }

    /// The next record, or None on shutdown.
    async fn next_record(&mut self) -> Option<Inbound> {
        loop {
            let received = tokio::select! {
                biased;
                _ = self.shutdown.wait_for(|stop| *stop) => return None,
                received = self.consumer.recv() => received.map(|message| Inbound::from_message(&message)),
            };
            match received {
                Ok(mut record) => {
                    self.decode(&mut record).await?;
                    return Some(record);
                }
                // librdkafka reconnects by itself; these are reports, not a state to act on
                Err(e) => warn!(error = %e, "kafka consumer error"),
            }
        }
    }

    /// A value in the Confluent wire format decoded to its JSON (with `consumer.registry`). A
    /// value that does not decode stays as it is: `classify` finds it is not JSON and it is
    /// dead-lettered. The registry not answering is waited out; None on shutdown.
    async fn decode(&mut self, record: &mut Inbound) -> Option<()> {
        use outbox_relay::record::registry::{Decoder, EncodeError};
        let Some(decoder) = &self.decoder else { return Some(()) };
        let Some(value) = record.payload.as_deref().filter(|v| Decoder::is_framed(v)) else {
            return Some(());
        };
        loop {
            match decoder.decode(value).await {
                Ok(json) => {
                    record.payload = Some(json.to_string().into_bytes());
                    return Some(());
                }
                Err(EncodeError::Mismatch { detail, .. }) => {
                    warn!(record = %record.position(), %detail, "value does not decode");
                    return Some(());
                }
                Err(e) => warn!(record = %record.position(), error = %e, "schema registry: retrying"),
            }
            tokio::select! {
                _ = self.shutdown.wait_for(|stop| *stop) => return None,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    async fn handle(&mut self, record: &Inbound) -> Result<Step, LedgerError> {
        match classify(record, &self.sources) {
            Ok(order) => self.apply(record, &order).await,
            Err(poison) => self.dead_letter_poison(record, &poison.0).await,
        }
    }

    /// Applies `order`, retrying contention up to `max_attempts` and outages without limit.
    async fn apply(&mut self, record: &Inbound, order: &OrderPlaced) -> Result<Step, LedgerError> {
        let max_attempts = self.config.consumer.max_attempts;
        let mut backoff = self.config.consumer.backoff();
        for attempt in 1.. {
            let error = match self.on_session(async |s| s.apply(order, record).await).await? {
                Attempt::Done(outcome) => {
                    self.count(record, order, outcome);
                    return Ok(Step::Done);
                }
                Attempt::Interrupted => return Ok(Step::Interrupted),
                Attempt::Failed(error) => error,
            };
            let reason = match crate::retry::classify(&error) {
                Failure::Contended if attempt < max_attempts => {
                    let error = describe(&error);
                    let event_id = &order.event_id;
                    warn!(%event_id, attempt, max_attempts, %error, "transaction failed, retrying");
                    if !self.pause(backoff.next_delay()).await {
                        return Ok(Step::Interrupted);
                    }
                    continue;
                }
                Failure::Contended => {
                    format!("{} after {attempt} attempts: {}", contention_name(&error), describe(&error))
                }
                Failure::Permanent => format!("the database refused the event: {}", describe(&error)),
                // (an outage never gets here: on_session waits it out)
                Failure::Fatal | Failure::Outage => {
                    let during = format!("applying event {} ({})", order.event_id, record.position());
                    return Err(LedgerError::Database { during, error: describe(&error) });
                }
            };
            return self.dead_letter(record, &order.event_id, &reason, attempt).await;
        }
        unreachable!("the attempts loop returns")
    }

    /// Exports `record`'s processing span, `span` (a child of the relay's publish span when the
    /// record's `traceparent` names one), with what became of it: the tally's change since
    /// `before`.
    fn traced(&self, record: &Inbound, span: &Begun, before: Tally) {
        let t = &self.tally;
        let outcome = [
            (t.debited > before.debited, "debited"),
            (t.declined > before.declined, "declined"),
            (t.duplicates > before.duplicates, "duplicate"),
            (t.dead_lettered > before.dead_lettered, "dead_lettered"),
        ];
        let outcome = outcome.iter().find(|(changed, _)| *changed).map_or("interrupted", |(_, o)| *o);
        let attributes = vec![
            ("messaging.system", Value::from("kafka")),
            ("messaging.operation.type", "process".into()),
            ("messaging.destination.name", record.topic.clone().into()),
            ("messaging.destination.partition.id", record.partition.to_string().into()),
            ("messaging.kafka.offset", Value::Int(record.offset)),
            ("messaging.message.id", record.event_id().into()),
            ("messaging.consumer.group.name", self.config.consumer.group_id.clone().into()),
            ("ledger.outcome", outcome.into()),
        ];
        let name = format!("process {}", record.topic);
        if let Some(tracer) = tracer() {
            tracer.finish(span.finish(name, Kind::Consumer, attributes));
        }
    }

    fn count(&mut self, record: &Inbound, order: &OrderPlaced, outcome: Outcome) {
        let (event_id, customer_id, total_cents) = (&order.event_id, &order.customer_id, order.total_cents);
        match outcome {
            Outcome::Debited => {
                self.tally.debited += 1;
                debug!(%event_id, %customer_id, total_cents, "debited");
            }
            Outcome::Declined(decline) => {
                self.tally.declined += 1;
                let reason = decline.detail;
                info!(%event_id, %customer_id, total_cents, %reason, "payment declined");
            }
            Outcome::Duplicate => {
                self.tally.duplicates += 1;
                debug!(%event_id, record = %record.position(), "duplicate delivery skipped");
            }
        }
    }

    /// Dead-letters a record that can never be applied, unless it is a redelivery: its event
    /// was applied, or this very record was dead-lettered before.
    ///
    /// Another copy of an event dead-lettered before (a replay from the dead-letter topic, or
    /// a second publication) that still cannot be read is dead-lettered again, not skipped:
    /// `replay-dlq` committed past the earlier dead letter, so skipping would leave no copy
    /// to replay once the cause is fixed, and the operator would learn of it only from a log
    /// line. A replay that fails in the transaction is dead-lettered again alike.
    async fn dead_letter_poison(&mut self, record: &Inbound, reason: &str) -> Result<Step, LedgerError> {
        let event_id = record.event_id();
        let during = format!("looking up event {event_id} in the inbox");
        let seen =
            match self.on_session_until_done(&during, async |s| s.seen(&event_id, record).await).await? {
                Attempt::Done(seen) => seen,
                Attempt::Interrupted => return Ok(Step::Interrupted),
                Attempt::Failed(e) => {
                    // cannot happen for an id record.rs accepted; dead-lettering costs at most a
                    // second copy, skipping could lose the record
                    warn!(%event_id, error = %describe(&e), "cannot look the event up in the inbox");
                    None
                }
            };
        match seen {
            Some(Seen { outcome, same_record }) if outcome != DEAD_LETTERED || same_record => {
                self.tally.duplicates += 1;
                debug!(%event_id, %outcome, record = %record.position(), "duplicate delivery skipped");
                Ok(Step::Done)
            }
            Some(_) => {
                info!(%event_id, record = %record.position(), "an event dead-lettered before arrived again");
                self.dead_letter(record, &event_id, reason, 1).await
            }
            None => self.dead_letter(record, &event_id, reason, 1).await,
        }
    }

    /// Produces the dead letter (waiting for the broker's acknowledgement), then records it.
    async fn dead_letter(
        &mut self,
        record: &Inbound,
        event_id: &str,
        reason: &str,
        attempts: u32,
    ) -> Result<Step, LedgerError> {
        let mut backoff = self.config.consumer.backoff();
        while let Err(e) = self.dead_letters.send(record, reason, attempts).await {
            warn!(%event_id, error = %e, "cannot produce the dead letter, retrying");
            if !self.pause(backoff.next_delay()).await {
                return Ok(Step::Interrupted);
            }
        }
        let during = format!("recording the dead letter of event {event_id}");
        let recorded = self
            .on_session_until_done(&during, async |s| s.record_dead_letter(event_id, record, reason).await);
        let position = record.position();
        match recorded.await? {
            Attempt::Done(()) => {
                warn!(%event_id, record = %position, %reason, attempts, "dead-lettered");
            }
            Attempt::Interrupted => return Ok(Step::Interrupted),
            Attempt::Failed(e) => {
                // the broker holds the dead letter, so committing loses nothing; stopping
                // instead would redeliver this record after the restart, to fail alike forever
                let error = describe(&e);
                error!(%event_id, record = %position, %reason, attempts, %error,
                    "dead-lettered, but the inbox refused its row: committing the offset anyway");
            }
        }
        self.tally.dead_lettered += 1;
        Ok(Step::Done)
    }

    /// As [`Ledger::on_session`], also retrying contention (a lock timeout on the inbox row)
    /// without limit: for the bookkeeping around a dead letter, which has no attempt budget.
    /// Fails with a [`Failure::Permanent`] error only (this record's); a fatal one stops the
    /// process, naming what it was `during`.
    async fn on_session_until_done<T>(
        &mut self,
        during: &str,
        mut op: impl AsyncFnMut(&mut Session) -> Result<T, tokio_postgres::Error>,
    ) -> Result<Attempt<T>, LedgerError> {
        let mut backoff = self.config.consumer.backoff();
        loop {
            let error = match self.on_session(&mut op).await? {
                Attempt::Failed(error) => error,
                done_or_interrupted => return Ok(done_or_interrupted),
            };
            match crate::retry::classify(&error) {
                Failure::Contended => {}
                Failure::Permanent => return Ok(Attempt::Failed(error)),
                // (an outage never gets here: on_session waits it out)
                Failure::Fatal | Failure::Outage => {
                    return Err(LedgerError::Database { during: during.into(), error: describe(&error) });
                }
            }
            let error = describe(&error);
            warn!(%error, "inbox statement failed, retrying");
            if !self.pause(backoff.next_delay()).await {
                return Ok(Attempt::Interrupted);
            }
        }
    }

    /// Runs `op` on a working session, reconnecting and running it again after an outage,
    /// without limit. Any other failure is returned.
    async fn on_session<T>(
        &mut self,
        mut op: impl AsyncFnMut(&mut Session) -> Result<T, tokio_postgres::Error>,
    ) -> Result<Attempt<T>, LedgerError> {
        loop {
            let Some(session) = self.session.as_mut() else {
                if !self.connect().await? {
                    return Ok(Attempt::Interrupted);
                }
                continue;
            };
            match op(session).await {
                Ok(value) => {
                    self.outage = self.config.consumer.backoff();
                    return Ok(Attempt::Done(value));
                }
                Err(error) if crate::retry::classify(&error) == Failure::Outage => {
                    let error = describe(&error);
                    warn!(%error, "database unavailable, retrying on a new session");
                    self.session = None;
                    let delay = self.outage.next_delay();
                    if !self.pause(delay).await {
                        return Ok(Attempt::Interrupted);
                    }
                }
                Err(error) => return Ok(Attempt::Failed(error)),
            }
        }
    }

    /// Opens a session, waiting out an unreachable database; false on shutdown.
    async fn connect(&mut self) -> Result<bool, LedgerError> {
        loop {
            let failure = match Session::open(&self.config.postgres, &self.config.consumer).await {
                Ok(session) => {
                    self.session = Some(session);
                    return Ok(true);
                }
                Err(OpenError::Fatal(e)) => return Err(e),
                Err(OpenError::Retry(failure)) => failure,
            };
            warn!(error = %failure, "cannot connect to the database, retrying");
            let delay = self.outage.next_delay();
            if !self.pause(delay).await {
                return Ok(false);
            }
        }
    }

    /// Sleeps `delay`; false when shutdown came first.
    async fn pause(&mut self, delay: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = self.shutdown.wait_for(|stop| *stop) => false,
        }
    }

    /// Stores offset + 1 of `record` and commits asynchronously (see the module doc).
    fn commit(&self, record: &Inbound) {
        if let Err(e) = self.consumer.store_offset(&record.topic, record.partition, record.offset) {
            // the partition was revoked meanwhile: its new owner redelivers the record
            debug!(error = %e, record = %record.position(), "offset not stored");
            return;
        }
        if let Err(e) = self.consumer.commit_consumer_state(CommitMode::Async) {
            warn!(error = %e, "offset commit failed");
        }
    }

    fn commit_final(&self) {
        match tokio::task::block_in_place(|| self.consumer.commit_consumer_state(CommitMode::Sync)) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            // the last records are redelivered after the restart, then skipped as duplicates
            Err(e) => warn!(error = %e, "final offset commit failed"),
        }
    }
}

/// The settings of a consumer in `group`: the relay's client settings (brokers, TLS, SASL),
/// offsets committed by the ledger, a new group from the earliest offset, committed records
/// only.
pub fn group_config(config: &LedgerConfig, group: &str) -> ClientConfig {
    let mut client = outbox_relay::sink::kafka::client_config(&config.kafka);
    client
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        // stored only once applied: a commit never names a record that is not
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        // librdkafka's default, set here because the ledger's effects rest on it: the records
        // of an aborted Kafka transaction stay in the log, and read_uncommitted would apply
        // them (and those of a transaction still open) although their producer took them back.
        // A relay with kafka.transactional sends an aborted transaction's events again in a
        // later one, which read_committed sees once
        .set("isolation.level", "read_committed");
    if client.get("session.timeout.ms").is_none() {
        client.set("session.timeout.ms", DEFAULT_SESSION_TIMEOUT_MS.to_string());
    }
    client
}

fn consumer(config: &LedgerConfig) -> Result<StreamConsumer<LedgerContext>, LedgerError> {
    group_config(config, &config.consumer.group_id)
        .create_with_context(LedgerContext)
        .map_err(|source| LedgerError::KafkaClient { client: "consumer", source })
}

/// The decoder of `consumer.registry`, when its url is set.
fn decoder(
    registry: &crate::config::RegistryConfig,
) -> Result<Option<outbox_relay::record::registry::Decoder>, LedgerError> {
    use outbox_relay::record::registry::{RegistryConfig, SchemaType};
    if registry.url.is_empty() {
        return Ok(None);
    }
    let mut config = RegistryConfig::new(registry.url.clone(), SchemaType::Avro);
    config.username = registry.username.clone();
    config.ca_file = registry.ca_file.clone();
    config.allow_http_credentials = registry.allow_http_credentials;
    config.load_secrets(&std::env::vars().collect());
    config.password_file = registry.password_file.clone();
    config
        .validate("consumer.registry")
        .map_err(|e| LedgerError::Config(outbox_relay::config::ConfigError::Load(e)))?;
    let decoder = outbox_relay::record::registry::Decoder::new(&config).map_err(|e| {
        // (the client's errors name `registry.<setting>`: here they are consumer.registry's)
        LedgerError::Config(outbox_relay::config::ConfigError::Load(
            e.replace("registry.", "consumer.registry."),
        ))
    })?;
    Ok(Some(decoder))
}
