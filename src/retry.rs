//! Capped exponential backoff with full jitter, and logging once per state change.

use std::time::Duration;

use rand::Rng;
use tokio::sync::watch;

use crate::config::RetryConfig;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(config: &RetryConfig) -> Self {
        Backoff {
            initial: Duration::from_millis(config.initial_backoff_ms),
            max: Duration::from_millis(config.max_backoff_ms),
            attempt: 0,
        }
    }

    /// The next delay: uniformly random in [cap/2, cap], cap = min(max, initial * 2^attempt).
    /// Half of the cap is kept fixed so a retry never fires immediately.
    pub fn next_delay(&mut self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(30)).unwrap_or(u32::MAX);
        let cap = self.initial.saturating_mul(factor).min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = cap / 2;
        half + rand::rng().random_range(Duration::ZERO..=cap - half)
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

/// How often a standby asks again to become active (the advisory lock in polling mode, the slot
/// in replication mode): the failover time once the active instance's session has ended.
pub const STANDBY_RETRY: Duration = Duration::from_millis(1_000);

/// Sleeps `delay`, or less if shutdown is requested meanwhile.
pub async fn wait_or_shutdown(delay: Duration, shutdown: &mut watch::Receiver<bool>) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = shutdown.changed() => {}
    }
}

/// Remembers the current failure kind so a persisting outage is logged once, not every retry.
#[derive(Debug, Default)]
pub struct OutageLog {
    current: Option<String>,
}

impl OutageLog {
    /// Logs `error` at WARN if its kind differs from the last one logged.
    pub fn failed(&mut self, kind: &str, error: &dyn std::fmt::Display, retry_in: Duration) {
        if self.current.as_deref() != Some(kind) {
            tracing::warn!(kind, %error, retry_in_ms = retry_in.as_millis() as u64, "relay degraded, retrying");
            self.current = Some(kind.to_string());
        } else {
            tracing::debug!(kind, %error, retry_in_ms = retry_in.as_millis() as u64, "still failing");
        }
    }

    /// Logs the recovery once.
    pub fn recovered(&mut self) {
        if let Some(kind) = self.current.take() {
            tracing::info!(previous = %kind, "relay recovered");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_are_capped() {
        let mut b = Backoff::new(&RetryConfig { initial_backoff_ms: 100, max_backoff_ms: 1_000 });
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100), "{first:?}");
        for _ in 0..40 {
            let d = b.next_delay();
            assert!(d <= Duration::from_millis(1_000) && d >= Duration::from_millis(25), "{d:?}");
        }
        let late = b.next_delay();
        assert!(late >= Duration::from_millis(500), "{late:?}");
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
