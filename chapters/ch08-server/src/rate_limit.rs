//! Per-key rate limits: requests per minute and tokens per minute, as token buckets.
//!
//! Each key has up to two buckets. A bucket holds at most its per-minute amount (`capacity`),
//! refills continuously at `capacity / 60` per second, and starts full, so a new key may burst
//! a whole minute's allowance at once. A request takes 1 from the requests bucket and its
//! token count (prompt + `max_tokens`) from the tokens bucket, from both or from neither.
//!
//! The levels are kept in integer units of 1/60e9 of a request (or token), so that one
//! nanosecond of refill adds exactly `capacity` units: no rounding error can make a request
//! that was told to wait `d` still not fit at `now + d`.
//!
//! The map of buckets grows by one entry per distinct key: the identities from
//! [`crate::auth`] (one per configured API key), or client addresses on an open server and for
//! failed authentications. Past [`PRUNE_AT`] entries, the keys whose buckets have refilled are
//! forgotten (a full bucket is what a new key gets anyway), so the map holds at most the keys
//! charged within about the last minute.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Units of bucket level per request (or token): nanoseconds per minute.
const UNITS: u128 = 60_000_000_000;
/// Keys held before the full ones are forgotten.
pub const PRUNE_AT: usize = 4096;

/// Per-key limits; `None` is unlimited. (`Some(0)` refuses everything; the CLI syntax rejects it.)
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
}

impl RateLimit {
    /// No limit at all.
    pub const UNLIMITED: RateLimit = RateLimit {
        requests_per_minute: None,
        tokens_per_minute: None,
    };
}

/// A `--rate-limit` value that does not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "invalid rate limit {input:?}: {reason} (expected REQUESTS or REQUESTS:TOKENS per minute, \
     e.g. \"60\" or \"60:20000\"; \"-\" or \"none\" means unlimited, e.g. \"-:20000\")"
)]
pub struct ParseRateLimitError {
    input: String,
    reason: String,
}

impl FromStr for RateLimit {
    type Err = ParseRateLimitError;

    /// CLI syntax: "REQUESTS" or "REQUESTS:TOKENS" per minute; "-" or "none" for either part
    /// is unlimited; 0 is rejected (a limit that refuses everything is a mistake).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |reason: String| ParseRateLimitError {
            input: s.to_string(),
            reason,
        };
        let (requests, tokens) = match s.trim().split_once(':') {
            Some((r, t)) => (r, Some(t)),
            None => (s.trim(), None),
        };
        let requests_per_minute = parse_part::<u32>(requests, "requests").map_err(fail)?;
        let tokens_per_minute = match tokens {
            Some(t) => parse_part::<u64>(t, "tokens").map_err(fail)?,
            None => None,
        };
        Ok(RateLimit {
            requests_per_minute,
            tokens_per_minute,
        })
    }
}

/// One part of the CLI syntax: a positive number, or "-" / "none" for unlimited.
fn parse_part<T>(part: &str, what: &str) -> Result<Option<T>, String>
where
    T: FromStr + PartialEq + From<u8>,
{
    let part = part.trim();
    if part == "-" || part.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    let value: T = part
        .parse()
        .map_err(|_| format!("{what} per minute {part:?} is not a whole number"))?;
    if value == T::from(0) {
        return Err(format!(
            "{what} per minute must be at least 1 (use \"-\" for unlimited)"
        ));
    }
    Ok(Some(value))
}

impl fmt::Display for RateLimit {
    /// The CLI syntax, so that `to_string().parse()` gives the same limit back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.requests_per_minute {
            Some(r) => write!(f, "{r}")?,
            None => f.write_str("-")?,
        }
        match self.tokens_per_minute {
            Some(t) => write!(f, ":{t}"),
            None => Ok(()),
        }
    }
}

/// Why a request was refused. Nothing was charged.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum RateLimited {
    /// The request fits after this long (if nothing else is charged meanwhile).
    #[error("Rate limit reached. Please try again in {:.3}s.", .0.as_secs_f64())]
    Wait(Duration),
    /// The request needs more tokens than the per-minute capacity: it can never fit.
    #[error(
        "Request too large: it needs {tokens} tokens but the limit is {limit} tokens per minute. \
         Reduce the prompt or max_tokens."
    )]
    TooLarge { tokens: u64, limit: u64 },
    /// The request is more sequences than the per-minute request capacity: it can never fit.
    #[error(
        "Request too large: it is {requests} sequences (prompts × n) but the limit is {limit} \
         requests per minute. Send fewer prompts or a smaller n."
    )]
    TooManySequences { requests: u64, limit: u64 },
}

impl RateLimited {
    /// Seconds for a `Retry-After` header: the wait rounded up, at least 1. `None` for
    /// [`RateLimited::TooLarge`], which retrying cannot fix.
    pub fn retry_after_secs(&self) -> Option<u64> {
        match self {
            RateLimited::Wait(d) => {
                let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
                Some(secs.max(1))
            }
            RateLimited::TooLarge { .. } | RateLimited::TooManySequences { .. } => None,
        }
    }
}

// ANCHOR: bucket
/// A continuously refilled bucket; `level` and `capacity` are in [`UNITS`] per unit.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// The per-minute amount: refill is `rate` units per nanosecond.
    rate: u128,
    /// Invariant: `level <= rate * UNITS` (the capacity).
    level: u128,
}

impl Bucket {
    fn full(per_minute: u64) -> Self {
        let rate = u128::from(per_minute);
        Bucket {
            rate,
            level: rate * UNITS,
        }
    }

    fn refill(&mut self, elapsed: Duration) {
        // ANCHOR: task_8_2
        let capacity = self.rate * UNITS;
        self.level = (self.level + elapsed.as_nanos().saturating_mul(self.rate)).min(capacity);
        // ANCHOR_END: task_8_2
    }

    /// How long until `amount` fits (zero if it fits now). `amount` must be at most the
    /// capacity, so the wait is at most a minute.
    fn wait_for(&self, amount: u64) -> Duration {
        // ANCHOR: task_8_2
        let need = u128::from(amount) * UNITS;
        let missing = need.saturating_sub(self.level);
        let nanos = missing.div_ceil(self.rate.max(1));
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        // ANCHOR_END: task_8_2
    }

    fn take(&mut self, amount: u64) {
        self.level -= u128::from(amount) * UNITS;
    }
}
// ANCHOR_END: bucket

/// The buckets of one key.
#[derive(Debug)]
struct KeyState {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    /// The latest `now` seen for this key: refill is counted from here.
    updated: Instant,
}

impl KeyState {
    /// Whether every bucket would be full at `now` (the key is as good as new).
    fn is_full(&self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.updated);
        [self.requests, self.tokens]
            .into_iter()
            .flatten()
            .all(|mut bucket| {
                bucket.refill(elapsed);
                bucket.level == bucket.rate * UNITS
            })
    }
}

/// Per-key token buckets; shared by all request handlers (the state is behind a mutex).
#[derive(Debug)]
pub struct RateLimiter {
    limit: RateLimit,
    keys: Mutex<HashMap<String, KeyState>>,
}

impl RateLimiter {
    pub fn new(limit: RateLimit) -> Self {
        RateLimiter {
            limit,
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// The configured limit.
    pub fn limit(&self) -> RateLimit {
        self.limit
    }

    /// How long until one more request of no tokens would fit for `key` at `now`, without
    /// charging anything: `Err(Wait)` if it would have to wait.
    pub fn peek(&self, key: &str, now: Instant) -> Result<(), RateLimited> {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(state) = keys.get(key) else {
            return Ok(());
        };
        let wait = state.requests.map_or(Duration::ZERO, |mut bucket| {
            bucket.refill(now.saturating_duration_since(state.updated));
            bucket.wait_for(1)
        });
        if wait.is_zero() {
            Ok(())
        } else {
            Err(RateLimited::Wait(wait))
        }
    }

    /// Charges one request of `tokens` tokens (prompt + max_tokens) to `key` at `now`.
    ///
    /// On refusal nothing is charged, and the error says how long until the request would fit
    /// ([`RateLimited::Wait`]) or that it never can ([`RateLimited::TooLarge`]: more tokens than
    /// the whole per-minute capacity). A `now` earlier than one already seen for the key is
    /// treated as that earlier-seen instant (time never runs backwards for a bucket).
    pub fn check(&self, key: &str, tokens: u64, now: Instant) -> Result<(), RateLimited> {
        self.check_many(key, 1, tokens, now)
    }

    /// The refusal no wait can lift: more tokens, or more requests, than a minute allows
    /// ([`RateLimited::TooLarge`], [`RateLimited::TooManySequences`]). Charges nothing.
    pub fn never(&self, requests: u64, tokens: u64) -> Result<(), RateLimited> {
        if let Some(limit) = self.limit.tokens_per_minute
            && tokens > limit
        {
            return Err(RateLimited::TooLarge { tokens, limit });
        }
        if let Some(limit) = self.limit.requests_per_minute.map(u64::from)
            && requests > limit
        {
            return Err(RateLimited::TooManySequences { requests, limit });
        }
        Ok(())
    }

    /// [`RateLimiter::check`] for `requests` requests at once (a request of several engine
    /// sequences is charged one request each). More requests than the per-minute capacity is
    /// [`RateLimited::TooLarge`], as is more tokens.
    pub fn check_many(
        &self,
        key: &str,
        requests: u64,
        tokens: u64,
        now: Instant,
    ) -> Result<(), RateLimited> {
        if self.limit == RateLimit::UNLIMITED {
            return Ok(());
        }
        self.never(requests, tokens)?;
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if keys.len() >= PRUNE_AT && !keys.contains_key(key) {
            keys.retain(|_, state| !state.is_full(now));
        }
        let state = keys.entry(key.to_string()).or_insert_with(|| KeyState {
            requests: self
                .limit
                .requests_per_minute
                .map(|r| Bucket::full(u64::from(r))),
            tokens: self.limit.tokens_per_minute.map(Bucket::full),
            updated: now,
        });
        let elapsed = now.saturating_duration_since(state.updated);
        state.updated = state.updated.max(now);
        for bucket in [&mut state.requests, &mut state.tokens]
            .into_iter()
            .flatten()
        {
            bucket.refill(elapsed);
        }

        let wait_requests = state
            .requests
            .map_or(Duration::ZERO, |b| b.wait_for(requests));
        let wait_tokens = state.tokens.map_or(Duration::ZERO, |b| b.wait_for(tokens));
        let wait = wait_requests.max(wait_tokens);
        if !wait.is_zero() {
            return Err(RateLimited::Wait(wait));
        }
        if let Some(b) = state.requests.as_mut() {
            b.take(requests);
        }
        if let Some(b) = state.tokens.as_mut() {
            b.take(tokens);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(s: &str) -> RateLimit {
        s.parse().unwrap()
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// `never` refuses what no wait can admit, as `check_many` does, and charges nothing.
    #[test]
    fn never_refuses_what_a_minute_cannot_hold_and_charges_nothing() {
        let limiter = RateLimiter::new(limit("4:100"));
        assert!(matches!(
            limiter.never(5, 10),
            Err(RateLimited::TooManySequences { .. })
        ));
        assert!(matches!(
            limiter.never(1, 101),
            Err(RateLimited::TooLarge { .. })
        ));
        assert!(limiter.never(4, 100).is_ok());
        // Nothing was charged: the whole minute's allowance is still there.
        assert!(limiter.check_many("k", 4, 100, Instant::now()).is_ok());
    }

    #[test]
    fn parses_cli_syntax() {
        let cases = [
            ("60", Some(60), None),
            ("60:20000", Some(60), Some(20000)),
            (" 5 : 100 ", Some(5), Some(100)),
            ("-:20000", None, Some(20000)),
            ("none:20000", None, Some(20000)),
            ("60:-", Some(60), None),
            ("none", None, None),
        ];
        for (text, requests, tokens) in cases {
            let parsed = limit(text);
            assert_eq!(parsed.requests_per_minute, requests, "{text}");
            assert_eq!(parsed.tokens_per_minute, tokens, "{text}");
            assert_eq!(parsed.to_string().parse::<RateLimit>().unwrap(), parsed);
        }
    }

    #[test]
    fn rejects_zero_and_garbage_with_clear_messages() {
        for (text, needle) in [
            ("0", "at least 1"),
            ("10:0", "at least 1"),
            ("", "not a whole number"),
            ("ten", "not a whole number"),
            ("-5", "not a whole number"),
            ("1.5", "not a whole number"),
            ("10:20:30", "not a whole number"),
            ("99999999999", "not a whole number"),
        ] {
            let err = text.parse::<RateLimit>().unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
            assert!(err.contains(&format!("{text:?}")), "{text}: {err}");
        }
    }

    #[test]
    fn unlimited_never_refuses() {
        let rl = RateLimiter::new(RateLimit::UNLIMITED);
        let t0 = Instant::now();
        for _ in 0..1000 {
            assert_eq!(rl.check("k", u64::MAX, t0), Ok(()));
        }
    }

    #[test]
    fn requests_bucket_starts_full_and_refills_continuously() {
        let rl = RateLimiter::new(limit("2"));
        let t0 = Instant::now();
        assert_eq!(rl.check("k", 0, t0), Ok(()));
        assert_eq!(rl.check("k", 0, t0), Ok(()));
        // Empty: one request refills in 60 s / 2 = 30 s.
        assert_eq!(rl.check("k", 0, t0), Err(RateLimited::Wait(secs(30.0))));
        assert_eq!(
            rl.check("k", 0, t0 + secs(10.0)),
            Err(RateLimited::Wait(secs(20.0)))
        );
        assert_eq!(rl.check("k", 0, t0 + secs(30.0)), Ok(()));
        assert!(rl.check("k", 0, t0 + secs(30.0)).is_err());
        // Refill stops at the capacity: after ten minutes, still only two.
        let later = t0 + secs(600.0);
        assert_eq!(rl.check("k", 0, later), Ok(()));
        assert_eq!(rl.check("k", 0, later), Ok(()));
        assert!(rl.check("k", 0, later).is_err());
    }

    #[test]
    fn keys_are_independent() {
        let rl = RateLimiter::new(limit("1"));
        let t0 = Instant::now();
        assert_eq!(rl.check("a", 0, t0), Ok(()));
        assert!(rl.check("a", 0, t0).is_err());
        assert_eq!(rl.check("b", 0, t0), Ok(()));
    }

    #[test]
    fn tokens_bucket_charges_prompt_plus_max_tokens() {
        let rl = RateLimiter::new(limit("-:600"));
        let t0 = Instant::now();
        assert_eq!(rl.check("k", 500, t0), Ok(()));
        // 100 left; 300 more need 200 more tokens = 20 s at 10 tokens/s.
        assert_eq!(rl.check("k", 300, t0), Err(RateLimited::Wait(secs(20.0))));
        assert_eq!(rl.check("k", 100, t0), Ok(()));
        assert_eq!(rl.check("k", 300, t0 + secs(30.0)), Ok(()));
    }

    #[test]
    fn refusal_charges_nothing() {
        let rl = RateLimiter::new(limit("10:100"));
        let t0 = Instant::now();
        assert_eq!(rl.check("k", 90, t0), Ok(()));
        // Refused on tokens: the request bucket must not be charged either.
        for _ in 0..20 {
            assert!(matches!(rl.check("k", 50, t0), Err(RateLimited::Wait(_))));
        }
        for _ in 0..9 {
            assert_eq!(rl.check("k", 1, t0), Ok(()));
        }
        // Now the request bucket (10 per minute) is empty: 6 s for one more.
        assert_eq!(rl.check("k", 0, t0), Err(RateLimited::Wait(secs(6.0))));
    }

    #[test]
    fn wait_is_the_longer_of_both_buckets_and_is_exact() {
        let rl = RateLimiter::new(limit("7:1000"));
        let t0 = Instant::now();
        assert_eq!(rl.check("k", 999, t0), Ok(()));
        // Requests: 6 left. Tokens: 1 left; 7 tokens need 6 more = 6 * 60/1000 s = 0.36 s.
        let Err(RateLimited::Wait(wait)) = rl.check("k", 7, t0) else {
            panic!("expected a wait");
        };
        assert_eq!(wait, Duration::from_millis(360));
        assert_eq!(rl.check("k", 7, t0 + wait), Ok(()));
        // An awkward rate: 7 requests per minute is 8.571428... s per request.
        let rl = RateLimiter::new(limit("7"));
        for _ in 0..7 {
            assert_eq!(rl.check("k", 0, t0), Ok(()));
        }
        let Err(RateLimited::Wait(wait)) = rl.check("k", 0, t0) else {
            panic!("expected a wait");
        };
        assert_eq!(wait.as_nanos(), 8_571_428_572); // rounded up, never down
        assert!(
            rl.check("k", 0, t0 + wait - Duration::from_nanos(1))
                .is_err()
        );
        assert_eq!(rl.check("k", 0, t0 + wait), Ok(()));
    }

    #[test]
    fn too_large_is_refused_outright() {
        let rl = RateLimiter::new(limit("60:1000"));
        let t0 = Instant::now();
        let err = rl.check("k", 1001, t0).unwrap_err();
        assert_eq!(
            err,
            RateLimited::TooLarge {
                tokens: 1001,
                limit: 1000
            }
        );
        assert_eq!(err.retry_after_secs(), None);
        assert!(err.to_string().contains("1001"));
        // Exactly the capacity fits a fresh key.
        assert_eq!(rl.check("k", 1000, t0), Ok(()));
    }

    #[test]
    fn many_sequences_are_charged_one_request_each() {
        let rl = RateLimiter::new(limit("10"));
        let t0 = Instant::now();
        assert_eq!(rl.check_many("k", 8, 0, t0), Ok(()));
        // 2 left: 3 more wait for one to refill (6 s at 10 per minute).
        assert_eq!(
            rl.check_many("k", 3, 0, t0),
            Err(RateLimited::Wait(secs(6.0)))
        );
        assert_eq!(rl.check_many("k", 2, 0, t0), Ok(()));
        let err = rl.check_many("k", 11, 0, t0).unwrap_err();
        assert_eq!(
            err,
            RateLimited::TooManySequences {
                requests: 11,
                limit: 10
            }
        );
        assert_eq!(err.retry_after_secs(), None);
    }

    #[test]
    fn peek_charges_nothing() {
        let rl = RateLimiter::new(limit("2"));
        let t0 = Instant::now();
        assert_eq!(rl.peek("k", t0), Ok(()));
        assert_eq!(rl.check("k", 0, t0), Ok(()));
        for _ in 0..5 {
            assert_eq!(rl.peek("k", t0), Ok(()));
        }
        assert_eq!(rl.check("k", 0, t0), Ok(()));
        assert_eq!(rl.peek("k", t0), Err(RateLimited::Wait(secs(30.0))));
        assert_eq!(rl.peek("k", t0 + secs(30.0)), Ok(()));
    }

    #[test]
    fn keys_whose_buckets_refilled_are_forgotten() {
        let rl = RateLimiter::new(limit("1"));
        let t0 = Instant::now();
        for i in 0..PRUNE_AT {
            assert_eq!(rl.check(&format!("client {i}"), 0, t0), Ok(()));
        }
        // A minute on, every bucket is full again: a new key prunes them all.
        let later = t0 + secs(60.0);
        assert_eq!(rl.check("new", 0, later), Ok(()));
        assert_eq!(rl.keys.lock().unwrap().len(), 1);
        // Within the minute nothing is forgotten, so nothing is refilled early.
        for i in 0..PRUNE_AT {
            assert_eq!(rl.check(&format!("again {i}"), 0, later), Ok(()));
        }
        assert_eq!(rl.check("one more", 0, later + secs(1.0)), Ok(()));
        assert!(rl.check("again 0", 0, later + secs(1.0)).is_err());
    }

    #[test]
    fn time_going_backwards_does_not_refill() {
        let rl = RateLimiter::new(limit("1"));
        let t0 = Instant::now() + secs(100.0);
        assert_eq!(rl.check("k", 0, t0), Ok(()));
        assert!(rl.check("k", 0, t0 - secs(50.0)).is_err());
        assert_eq!(
            rl.check("k", 0, t0 + secs(30.0)),
            Err(RateLimited::Wait(secs(30.0)))
        );
    }

    #[test]
    fn retry_after_rounds_up_to_at_least_one_second() {
        assert_eq!(
            RateLimited::Wait(Duration::from_millis(1)).retry_after_secs(),
            Some(1)
        );
        assert_eq!(RateLimited::Wait(secs(2.0)).retry_after_secs(), Some(2));
        assert_eq!(RateLimited::Wait(secs(2.001)).retry_after_secs(), Some(3));
    }

    #[test]
    fn limiter_is_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<RateLimiter>();
        let rl = std::sync::Arc::new(RateLimiter::new(limit("100")));
        let t0 = Instant::now();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let rl = rl.clone();
                std::thread::spawn(move || (0..50).filter(|_| rl.check("k", 0, t0).is_ok()).count())
            })
            .collect();
        let granted: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(granted, 100);
    }
}
