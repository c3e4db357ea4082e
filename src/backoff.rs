//! Capped exponential backoff, and the wait that shutdown cuts short: the one backoff of the relay
//! (between sessions, at a held poison event) and of the example services.
//!
//! Invariants:
//! - the n-th cap (0-based) is `min(max, initial * 2^n)`; it never overflows and never exceeds
//!   `max`;
//! - with [`Jitter::Equal`] (the relay's) a delay is uniform in `[cap/2, cap]`, so a retry never
//!   fires at once; with [`Jitter::Full`] it is uniform in `[0, cap]`, so clients that failed
//!   together spread out the most (AWS Architecture Blog, "Exponential Backoff and Jitter");
//! - [`wait_or_shutdown`] returns as soon as shutdown is requested, whatever the delay.

use std::time::Duration;

use rand::Rng;
use tokio::sync::watch;

use crate::config::RetryConfig;

/// How a delay is drawn under its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Uniform in `[cap/2, cap]`.
    Equal,
    /// Uniform in `[0, cap]`.
    Full,
}

/// Capped exponential backoff with jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    jitter: Jitter,
    attempt: u32,
}

impl Backoff {
    /// Starts at `initial`, doubling up to `max`.
    pub fn new(initial: Duration, max: Duration, jitter: Jitter) -> Backoff {
        Backoff { initial, max, jitter, attempt: 0 }
    }

    /// The relay's backoff: `retry.initial_backoff_ms` up to `retry.max_backoff_ms`, equal jitter.
    pub fn from_config(config: &RetryConfig) -> Backoff {
        let (initial, max) =
            (Duration::from_millis(config.initial_backoff_ms), Duration::from_millis(config.max_backoff_ms));
        Backoff::new(initial, max, Jitter::Equal)
    }

    /// The longest delay this backoff chooses.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The cap the next delay is drawn under.
    pub fn cap(&self) -> Duration {
        ceiling(self.initial, self.max, self.attempt)
    }

    /// The next delay, drawn under the next cap.
    pub fn next_delay(&mut self) -> Duration {
        let cap = self.cap();
        self.attempt = self.attempt.saturating_add(1);
        draw(cap, self.jitter, &mut rand::rng())
    }

    /// Back to the first delay.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// `min(max, initial * 2^attempt)`, for a caller that counts its attempts itself.
pub fn ceiling(initial: Duration, max: Duration, attempt: u32) -> Duration {
    let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
    initial.saturating_mul(factor).min(max)
}

/// A delay under `cap`, as `jitter` says, from `rng` (a test passes a seeded one).
pub fn draw(cap: Duration, jitter: Jitter, rng: &mut impl Rng) -> Duration {
    let floor = match jitter {
        Jitter::Equal => cap / 2,
        Jitter::Full => Duration::ZERO,
    };
    floor + rng.random_range(Duration::ZERO..=cap - floor)
}

/// Sleeps `delay`, or less if shutdown is requested meanwhile.
pub async fn wait_or_shutdown(delay: Duration, shutdown: &mut watch::Receiver<bool>) {
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = shutdown.changed() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_are_capped() {
        let mut b = Backoff::from_config(&RetryConfig { initial_backoff_ms: 100, max_backoff_ms: 1_000 });
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

    #[test]
    fn the_cap_doubles_up_to_the_maximum() {
        let mut backoff =
            Backoff::new(Duration::from_millis(100), Duration::from_millis(1_000), Jitter::Full);
        let mut caps = Vec::new();
        for _ in 0..6 {
            caps.push(backoff.cap().as_millis());
            backoff.next_delay();
        }
        assert_eq!(caps, [100, 200, 400, 800, 1_000, 1_000]);
        for _ in 0..100 {
            backoff.next_delay();
        }
        assert_eq!(backoff.cap(), Duration::from_millis(1_000));
        assert_eq!(
            ceiling(Duration::from_millis(100), Duration::from_secs(30), u32::MAX),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn every_full_jitter_delay_is_within_its_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(50), Jitter::Full);
        let mut seen_below_half = false;
        for _ in 0..200 {
            let cap = backoff.cap();
            let delay = backoff.next_delay();
            assert!(delay <= cap, "{delay:?} > {cap:?}");
            seen_below_half |= delay < cap / 2;
        }
        // full jitter: delays reach below the half that equal jitter keeps
        assert!(seen_below_half);
    }
}
