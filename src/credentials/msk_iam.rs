//! AWS MSK IAM (placeholder while the signer is written).

use super::{FetchError, Token};
use crate::config::KafkaAuthConfig;

pub(super) struct MskIam;

impl MskIam {
    pub(super) fn new(_auth: &KafkaAuthConfig) -> Result<MskIam, FetchError> {
        Ok(MskIam)
    }
    pub(super) async fn fetch(&self) -> Result<Token, FetchError> {
        Err(FetchError::Unavailable("msk_iam is not built yet".into()))
    }
}
