//! A token bucket per caller, in this process: `burst` requests at once, refilled at
//! `requests_per_sec`.
//!
//! Each replica counts on its own, so N replicas allow a caller up to N times the rate; the
//! limit protects a replica and its database sessions from one caller, it is not a quota.
//! Buckets that have refilled are forgotten, so memory grows with the callers active within
//! about `burst / requests_per_sec` seconds, not with every caller ever seen.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::RateLimitConfig;

/// Buckets kept before the full ones are swept out.
const SWEEP_AT: usize = 10_000;

pub struct RateLimiter {
    per_sec: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RateLimiter {
    pub fn new(config: &RateLimitConfig) -> RateLimiter {
        RateLimiter {
            per_sec: config.requests_per_sec,
            burst: config.burst as f64,
            buckets: Mutex::default(),
        }
    }

    /// Takes one request from `caller`'s bucket; Err: the wait until the next one is allowed.
    pub fn admit(&self, caller: &str) -> Result<(), Duration> {
        self.admit_at(caller, Instant::now())
    }

    fn admit_at(&self, caller: &str, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().unwrap();
        if buckets.len() >= SWEEP_AT && !buckets.contains_key(caller) {
            buckets.retain(|_, b| self.refilled(*b, now) < self.burst);
        }
        let bucket = buckets.entry(caller.to_string()).or_insert(Bucket { tokens: self.burst, at: now });
        bucket.tokens = self.refilled(*bucket, now);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - bucket.tokens) / self.per_sec))
        }
    }

    fn refilled(&self, bucket: Bucket, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        (bucket.tokens + elapsed * self.per_sec).min(self.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(per_sec: f64, burst: u32) -> RateLimiter {
        RateLimiter::new(&RateLimitConfig { requests_per_sec: per_sec, burst })
    }

    #[test]
    fn a_caller_gets_its_burst_then_waits_for_the_refill_and_others_are_not_affected() {
        let limiter = limiter(2.0, 3);
        let start = Instant::now();
        for _ in 0..3 {
            assert!(limiter.admit_at("a", start).is_ok());
        }
        let wait = limiter.admit_at("a", start).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert!(limiter.admit_at("b", start).is_ok());
        assert!(limiter.admit_at("a", start + Duration::from_millis(500)).is_ok());
        assert!(limiter.admit_at("a", start + Duration::from_millis(600)).is_err());
    }

    #[test]
    fn refilled_buckets_are_swept_when_many_callers_were_seen() {
        let limiter = limiter(1000.0, 1);
        let start = Instant::now();
        for n in 0..SWEEP_AT {
            limiter.admit_at(&format!("c{n}"), start).unwrap();
        }
        limiter.admit_at("late", start + Duration::from_secs(1)).unwrap();
        assert_eq!(limiter.buckets.lock().unwrap().len(), 1);
    }
}
