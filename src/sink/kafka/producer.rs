//! The record producer: librdkafka's producer with the relay's context, whose delivery reports
//! arrive numbered on a channel, and the relay's own headers.
//!
//! Invariants:
//! - every record handed to a producer gets exactly one report on its channel: from
//!   librdkafka's delivery callback, or (refused at once) from the sink's `enqueue`;
//! - the producer's queue is served on the runtime thread, until empty each time librdkafka
//!   signals it ([`serve_on_runtime`]); the queue's handle goes before the producer, and the
//!   producer is destroyed off the runtime.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::bindings as rdsys;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientContext, Message};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use super::client::{log_librdkafka, producer_config, transactional_producer_config};
use crate::config::KafkaConfig;
use crate::sink::{Report, SendFailure, Written};

/// The header naming the database and table a record came from (see [`super::KafkaSink::set_source`]).
pub(crate) const SOURCE_HEADER: &str = "outbox_relay_source";
/// The header saying where the source read the record ([`crate::record::Position`]).
pub(crate) const POSITION_HEADER: &str = "outbox_relay_position";
/// The header `outbox-relay replay-dead-letters` marks a replayed record with (the letter's id):
/// a replay comes after later events of its key and carries the letter's data as fixed, so
/// `verify` neither orders nor compares it.
pub(crate) const REPLAYED_HEADER: &str = "outbox_relay_replayed";
/// The header `outbox-relay republish` adds to a record it sends again as first written (when,
/// in Unix milliseconds): `verify` compares the copy without it.
pub(crate) const REPUBLISHED_HEADER: &str = "outbox_relay_republished";
/// The header of the one record the relay writes to a pinned partition in a transaction it
/// aborts at once (`transaction::unpin`): a `read_committed` reader never sees it, a
/// `read_uncommitted` one sees a record with this header, an empty value and key
/// [`UNPIN_HEADER`].
pub(crate) const UNPIN_HEADER: &str = "outbox_relay_unpin";

/// Delivery reports from librdkafka's callback (usually on the runtime thread, see
/// [`serve_on_runtime`]; a flush serves them on its blocking thread) into a
/// channel, numbered by the record's delivery opaque: no future, oneshot or box per record.
pub(super) struct Reporter(mpsc::UnboundedSender<Report>);

/// librdkafka's log lines and global errors, at the relay's levels.
impl ClientContext for Reporter {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(
        &self,
        config: Option<&str>,
    ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
        super::client::oauth_token(config)
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log_librdkafka(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let (level, what) = match error.rdkafka_error_code() {
            // a broker connection that dropped (idle, restarted, a leader moved): librdkafka
            // reconnects by itself, and the stall watch says when Kafka stops acknowledging
            Some(RDKafkaErrorCode::BrokerTransportFailure) => {
                (tracing::Level::INFO, "Kafka connection lost; reconnecting")
            }
            Some(RDKafkaErrorCode::AllBrokersDown) => {
                (tracing::Level::WARN, "no Kafka broker reachable; reconnecting")
            }
            _ => (tracing::Level::ERROR, "Kafka producer error"),
        };
        super::client::log_client_error(level, &error, reason, what);
    }
}

impl ProducerContext for Reporter {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, seq: usize) {
        let outcome = match result {
            Ok(message) => Ok(Written { partition: message.partition(), offset: message.offset() }),
            Err((e, _)) => Err(SendFailure::kafka(e.clone())),
        };
        // closed: the sink replaced this producer, and nobody waits for its reports any more
        let _ = self.0.send(Report { seq, outcome });
    }
}

/// How long the queue goes unserved at most without librdkafka's signal (a safety net: it
/// signals when its queue turns non-empty, and again after each time the queue was served).
const UNSIGNALLED_SERVE_INTERVAL: Duration = Duration::from_secs(1);
/// Events served between two yields to the runtime's other tasks while the queue stays full.
const SERVE_TURN: usize = 64;

/// librdkafka's producer, its queue (delivery reports into [`Reporter`], logs, errors, OAuth
/// token refreshes) served on the runtime thread when librdkafka signals it
/// ([`serve_on_runtime`]). Dropped, it releases its share of the producer, then tells that task
/// to stop, and does not wait: the task holds the last share and destroys the producer off the
/// runtime (whatever is still queued is purged; the sink flushed what it needed before). A
/// runtime shut down with the task pending destroys it on the thread shutting it down.
pub(super) struct RecordProducer {
    /// `None` only inside Drop.
    producer: Option<Arc<BaseProducer<Reporter>>>,
    stop: Arc<Stop>,
}

/// The stop signal of the task serving a producer's queue.
#[derive(Default)]
struct Stop {
    stopped: AtomicBool,
    notify: tokio::sync::Notify,
}

impl RecordProducer {
    /// Must be called on the runtime (every producer of the relay's is made in async code).
    fn start(producer: BaseProducer<Reporter>) -> std::io::Result<RecordProducer> {
        let runtime = tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
        let producer = Arc::new(producer);
        let stop = Arc::new(Stop::default());
        let wake = QueueWake::new(&producer)?;
        let serving = runtime.spawn(serve_on_runtime(producer.clone(), wake, stop.clone()));
        // a callback that panicked ended the serving: no report arrives any more (the stall
        // watch then says so); the reason is logged here
        runtime.spawn(async move {
            if let Err(e) = serving.await
                && e.is_panic()
            {
                tracing::error!(error = %e, "the Kafka producer's queue is no longer served: a callback panicked");
            }
        });
        Ok(RecordProducer { producer: Some(producer), stop })
    }
}

/// Serves the producer's queue on the runtime thread each time librdkafka writes to `wake`,
/// until stopped.
///
/// A thread polling the queue instead (`ThreadedProducer`, or the relay's own before) woke once
/// per batch of reports and then woke the runtime thread through the reports channel: two
/// wake-ups of two threads per acknowledgement. At 2,000 events/s that thread's wake-ups cost
/// a fifth of the relay's CPU (BENCHMARKS.md, "At 2,000 events/s"). Here the runtime thread
/// wakes once, and the reports it sends into the channel are received on the same thread.
///
/// The callbacks then run on the runtime thread: a delivery report is a channel send, a log
/// line a `tracing` event; an OAuth token refresh reads the token source's current token,
/// which waits only until the source's first fetch (at most its request timeout): the daemon
/// awaits that fetch before it makes its producer; the one-shot commands (`setup`,
/// `republish`, `replay-dead-letters`) may wait there once, as they start.
async fn serve_on_runtime(producer: Arc<BaseProducer<Reporter>>, wake: QueueWake, stop: Arc<Stop>) {
    let mut safety_net = tokio::time::interval(UNSIGNALLED_SERVE_INTERVAL);
    safety_net.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut signalled = true;
    while !stop.stopped.load(Ordering::Relaxed) {
        tokio::select! {
            ready = wake.fd.readable(), if signalled => match ready {
                Ok(mut guard) => {
                    wake.drain();
                    guard.clear_ready();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the Kafka producer's wake-up failed; serving its queue every second");
                    signalled = false;
                }
            },
            _ = safety_net.tick() => {}
            _ = stop.notify.notified() => break,
        }
        // serve until empty (one event per poll: a batch of reports, a log line, ...): librdkafka
        // signals again only once the queue was served, so waiting with events left would wait
        // for the safety net; a long run yields to the other tasks now and then
        let mut served = 0;
        while wake.queued() > 0 {
            producer.poll(Duration::ZERO);
            served += 1;
            if served % SERVE_TURN == 0 {
                tokio::task::yield_now().await;
            }
        }
    }
    // the queue handle before the producer: it must not outlive it
    drop(wake);
    // destroying a producer waits for its threads, which a frozen broker can hold up: not on a
    // runtime thread
    tokio::task::spawn_blocking(move || drop(producer));
}

/// librdkafka's main queue of a producer, set to write to an eventfd when it has events to
/// serve.
///
/// Invariants: librdkafka stops writing to the eventfd (io events disabled) before the eventfd
/// closes, and the queue handle is destroyed before the producer (the serving task drops this
/// first).
struct QueueWake {
    queue: *mut rdsys::rd_kafka_queue_t,
    fd: AsyncFd<OwnedFd>,
}

// SAFETY: librdkafka's queue handles are thread-safe; the handle is only read through
// librdkafka's calls and destroyed once, in Drop.
unsafe impl Send for QueueWake {}
unsafe impl Sync for QueueWake {}

impl QueueWake {
    fn new(producer: &BaseProducer<Reporter>) -> std::io::Result<QueueWake> {
        // SAFETY: plain system call; the descriptor is owned below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // registered before librdkafka may write to it: a failure here has nothing to undo
        // SAFETY: an OwnedFd returns its one open descriptor for as long as it lives, which is
        // as long as the AsyncFd owning it
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(std::io::Error::from)?;
        // SAFETY: the client outlives this handle (the serving task holds both, and drops this
        // first); the handle is a new reference, destroyed in Drop.
        let queue = unsafe { rdsys::rd_kafka_queue_get_main(producer.client().native_ptr()) };
        // an eventfd takes writes of 8 bytes, each adding to its counter
        let one = 1u64.to_ne_bytes();
        // SAFETY: librdkafka copies the payload; the descriptor stays open until Drop disables
        // the writes.
        unsafe {
            rdsys::rd_kafka_queue_io_event_enable(queue, fd.as_raw_fd(), one.as_ptr().cast(), one.len())
        };
        Ok(QueueWake { queue, fd })
    }

    /// Events queued, not served yet.
    fn queued(&self) -> usize {
        // SAFETY: a live queue handle (see Drop)
        unsafe { rdsys::rd_kafka_queue_length(self.queue) }
    }

    /// Resets the eventfd's counter (a read returns and zeroes it).
    fn drain(&self) {
        let mut counter = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `counter`; EAGAIN (already zero) is fine
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), counter.as_mut_ptr().cast(), counter.len()) };
    }
}

impl Drop for QueueWake {
    fn drop(&mut self) {
        // SAFETY: the handle is live until destroyed here; librdkafka stops writing to the
        // descriptor before it is closed (after this, with `fd`)
        unsafe {
            rdsys::rd_kafka_queue_io_event_enable(self.queue, -1, std::ptr::null(), 0);
            rdsys::rd_kafka_queue_destroy(self.queue);
        }
    }
}

impl std::ops::Deref for RecordProducer {
    type Target = BaseProducer<Reporter>;

    fn deref(&self) -> &BaseProducer<Reporter> {
        self.producer.as_ref().expect("taken only by Drop")
    }
}

impl Drop for RecordProducer {
    fn drop(&mut self) {
        // first, so that the serving task holds the last share, whichever thread it runs on
        drop(self.producer.take());
        self.stop.stopped.store(true, Ordering::Relaxed);
        // (a permit: the task takes it at its next wait if it is not waiting now)
        self.stop.notify.notify_one();
    }
}

/// A producer, and the channel its reports arrive on (with a sender for refusals at enqueue).
pub(super) struct Channel {
    pub(super) producer: Arc<RecordProducer>,
    pub(super) reports: mpsc::UnboundedReceiver<Report>,
    pub(super) refusals: mpsc::UnboundedSender<Report>,
}

/// A producer for `config`, transactional under `transactional_id` when given.
pub(super) fn create_producer(
    config: &KafkaConfig,
    transactional_id: Option<&str>,
) -> Result<Channel, KafkaError> {
    let (refusals, reports) = mpsc::unbounded_channel();
    let settings = match transactional_id {
        Some(id) => transactional_producer_config(config, id),
        None => producer_config(config),
    };
    let producer = settings.create_with_context(Reporter(refusals.clone()))?;
    let producer = RecordProducer::start(producer).map_err(|e| {
        KafkaError::ClientCreation(format!(
            "cannot watch the Kafka producer's queue (an eventfd registered with the runtime): {e}"
        ))
    })?;
    Ok(Channel { producer: Arc::new(producer), reports, refusals })
}
