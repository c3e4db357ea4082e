//! A small pool of PostgreSQL sessions, each opened with the relay's `postgres::connect` (TLS,
//! multi-host, password files). A request holds one session for its transaction; a session that
//! broke is dropped instead of returned, and the next request opens a fresh one.

use std::sync::{Arc, Mutex};

use outbox_relay::config::PostgresConfig;
use outbox_relay::error::RelayError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::Client;

pub struct Pool {
    pg: PostgresConfig,
    idle: Mutex<Vec<Client>>,
    permits: Arc<Semaphore>,
}

/// A session lent by the pool; returned when dropped, unless it broke.
pub struct Session<'a> {
    client: Option<Client>,
    pool: &'a Pool,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    pub fn new(pg: PostgresConfig, size: usize) -> Pool {
        Pool { pg, idle: Mutex::new(Vec::new()), permits: Arc::new(Semaphore::new(size)) }
    }

    /// An idle session, or a new one; waits while `size` sessions are lent.
    pub async fn get(&self) -> Result<Session<'_>, RelayError> {
        let permit = self.permits.clone().acquire_owned().await.expect("the semaphore is never closed");
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
