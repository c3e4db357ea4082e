use super::*;

fn config(properties: &[(&str, &str)]) -> KafkaConfig {
    KafkaConfig {
        brokers: vec!["127.0.0.1:9092".into()],
        client_id: "c".into(),
        message_timeout_ms: 0,
        stall_warning_ms: 10_000,
        linger_ms: 5,
        compression: "none".into(),
        source_headers: true,
        transactional: false,
        transactional_id: String::new(),
        transaction_timeout_ms: DEFAULT_KAFKA_TRANSACTION_TIMEOUT_MS,
        transaction_max_events: DEFAULT_KAFKA_TRANSACTION_MAX_EVENTS,
        transaction_max_bytes: DEFAULT_KAFKA_TRANSACTION_MAX_BYTES,
        transaction_max_ms: DEFAULT_KAFKA_TRANSACTION_MAX_MS,
        properties: properties.iter().map(|(k, v)| (k.to_string(), KafkaProperty(v.to_string()))).collect(),
        secret_properties_file: String::new(),
        secret_properties: BTreeMap::new(),
        auth: None,
    }
}

#[test]
fn the_principal_named_is_the_secret_files_when_it_sets_the_username_again() {
    let mut kafka = config(&[("security.protocol", "SASL_SSL"), ("sasl.username", "outbox-relay")]);
    assert_eq!(kafka.principal(), "principal User:outbox-relay");
    kafka.secret_properties.insert("sasl.username".into(), Secret::new("outbox-relay-verify"));
    assert_eq!(kafka.principal(), "principal User:outbox-relay-verify");
}

#[test]
fn oauthbearer_without_kafka_auth_and_librdkafkas_oidc_are_refused_naming_kafka_auth() {
    for properties in [
        &[("security.protocol", "SASL_SSL"), ("sasl.mechanism", "OAUTHBEARER")][..],
        &[("sasl.mechanisms", "OAUTHBEARER"), ("sasl.oauthbearer.method", "oidc")][..],
        &[("sasl.oauthbearer.method", "OIDC")][..],
    ] {
        let err = config(properties).validate().unwrap_err().to_string();
        assert!(err.contains("[kafka.auth]") && err.contains("libcurl"), "{properties:?}: {err}");
    }
    assert!(config(&[("sasl.mechanism", "SCRAM-SHA-512")]).validate().is_ok());
}

#[test]
fn the_binary_has_tls_sasl_and_zstd() {
    let features = built_in_features();
    for feature in ["ssl", "sasl_plain", "sasl_scram", "zstd"] {
        assert!(features.iter().any(|f| f == feature), "{feature} missing from {features:?}");
    }
}
