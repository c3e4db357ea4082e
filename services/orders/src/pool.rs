//! A small pool of PostgreSQL sessions, each opened with the relay's `postgres::connect` (TLS,
//! multi-host, password files). A request holds one session for its transaction; a session that
//! broke is dropped instead of returned, and the next request opens a fresh one. A request waits
//! for a session at most `http.pool_wait_ms`: under overload, requests are refused (503) rather
//! than queued without end.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_relay::config::PostgresConfig;
use outbox_relay::error::RelayError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::Client;

pub struct Pool {
    pg: PostgresConfig,
    wait: Duration,
    idle: Mutex<Vec<Client>>,
    permits: Arc<Semaphore>,
}

/// A session lent by the pool; returned when dropped, unless it broke.
pub struct Session<'a> {
    client: Option<Client>,
    pool: &'a Pool,
    _permit: OwnedSemaphorePermit,
}

/// Why no session was lent.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("every session stayed busy for {0:?} (http.pool_size sessions, http.pool_wait_ms)")]
    Busy(Duration),
    #[error(transparent)]
    Connect(#[from] RelayError),
}

impl Pool {
    pub fn new(pg: PostgresConfig, size: usize, wait: Duration) -> Pool {
        Pool { pg, wait, idle: Mutex::new(Vec::new()), permits: Arc::new(Semaphore::new(size)) }
    }

    /// An idle session, or a new one; waits up to the pool's wait while `size` sessions are lent.
    pub async fn get(&self) -> Result<Session<'_>, PoolError> {
        let permit = tokio::time::timeout(self.wait, self.permits.clone().acquire_owned())
            .await
            .map_err(|_| PoolError::Busy(self.wait))?
            .expect("the semaphore is never closed");
        let idle = self.idle.lock().unwrap().pop().filter(|c| !c.is_closed());
        let client = match idle {
            Some(client) => client,
            None => outbox_relay::postgres::connect(&self.pg).await?,
        };
        Ok(Session { client: Some(client), pool: self, _permit: permit })
    }
}

impl std::ops::Deref for Session<'_> {
    type Target = Client;
    fn deref(&self) -> &Client {
        self.client.as_ref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for Session<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        self.client.as_mut().expect("present until dropped")
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take().filter(|c| !c.is_closed()) {
            self.pool.idle.lock().unwrap().push(client);
        }
    }
}
