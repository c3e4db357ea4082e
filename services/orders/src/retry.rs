//! How a client retries `POST /orders`: the policy the load generator (`orders-load`) and the
//! demo use, as a template for callers of any idempotent API.
//!
//! | outcome | retry? | why |
//! |---|---|---|
//! | no response (connection refused or reset, timeout) | yes | the order may or may not exist; the same key makes asking again safe |
//! | 500, 502, 503, 504 | yes | the server or a proxy failed; nothing or everything was written, and the key tells which |
//! | 429 | yes, after `Retry-After` | the server asked for less load |
//! | 409 | yes, after `Retry-After` | another attempt with this key is in progress |
//! | 400, 422, other 4xx | never | the request itself is wrong; asking again gets the same answer |
//! | 2xx | done | a replayed 2xx is the original answer |
//!
//! Every retry sends the same key and the same body. The pause before attempt n is full jitter,
//! uniform in [0, min(cap, base * 2^n)] (AWS Architecture Blog, "Exponential Backoff and
//! Jitter"), so clients that failed together do not retry together; a `Retry-After` is a floor.

use std::time::Duration;

use outbox_relay::backoff::{self, Jitter};
use rand::Rng;

/// What one attempt got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Response { status: u16, retry_after: Option<Duration> },
    NoResponse,
}

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Done,
    RetryAfter(Duration),
    GiveUp,
}

#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy { max_attempts: 10, base: Duration::from_millis(50), cap: Duration::from_secs(5) }
    }
}

impl Policy {
    /// After attempt `attempt` (1-based) ended in `outcome`.
    pub fn decide(&self, attempt: u32, outcome: Outcome, rng: &mut impl Rng) -> Decision {
        let retry_after = match outcome {
            Outcome::Response { status, .. } if (200..300).contains(&status) => return Decision::Done,
            Outcome::Response { status, retry_after } if is_retryable(status) => retry_after,
            Outcome::Response { .. } => return Decision::GiveUp,
            Outcome::NoResponse => None,
        };
        if attempt >= self.max_attempts {
            return Decision::GiveUp;
        }
        let jitter = backoff::draw(backoff::ceiling(self.base, self.cap, attempt), Jitter::Full, rng);
        Decision::RetryAfter(jitter.max(retry_after.unwrap_or_default()))
    }
}

/// The statuses worth asking again with the same key.
pub fn is_retryable(status: u16) -> bool {
    matches!(status, 409 | 429 | 500 | 502 | 503 | 504)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: u16) -> Outcome {
        Outcome::Response { status, retry_after: None }
    }

    #[test]
    fn retries_what_may_succeed_and_never_what_cannot() {
        let (policy, mut rng) = (Policy::default(), rand::rng());
        for status in [409, 429, 500, 502, 503, 504] {
            assert!(
                matches!(policy.decide(1, response(status), &mut rng), Decision::RetryAfter(_)),
                "{status}"
            );
        }
        assert!(matches!(policy.decide(1, Outcome::NoResponse, &mut rng), Decision::RetryAfter(_)));
        for status in [400, 401, 403, 404, 422] {
            assert_eq!(policy.decide(1, response(status), &mut rng), Decision::GiveUp, "{status}");
        }
        assert_eq!(policy.decide(1, response(201), &mut rng), Decision::Done);
        assert_eq!(policy.decide(1, response(200), &mut rng), Decision::Done);
    }

    #[test]
    fn the_pause_is_jittered_under_a_growing_cap_and_honours_retry_after() {
        let (policy, mut rng) = (Policy::default(), rand::rng());
        for attempt in 1..9 {
            let Decision::RetryAfter(pause) = policy.decide(attempt, Outcome::NoResponse, &mut rng) else {
                panic!("attempt {attempt} not retried");
            };
            assert!(pause <= (policy.base * 2u32.pow(attempt)).min(policy.cap), "{pause:?} at {attempt}");
        }
        let pauses: Vec<_> = (0..20).map(|_| policy.decide(3, Outcome::NoResponse, &mut rng)).collect();
        assert!(pauses.windows(2).any(|w| w[0] != w[1]), "no jitter: {pauses:?}");
        let asked = Outcome::Response { status: 429, retry_after: Some(Duration::from_secs(2)) };
        let Decision::RetryAfter(pause) = policy.decide(1, asked, &mut rng) else {
            panic!("429 not retried")
        };
        assert!(pause >= Duration::from_secs(2));
        assert_eq!(policy.decide(policy.max_attempts, Outcome::NoResponse, &mut rng), Decision::GiveUp);
    }
}
