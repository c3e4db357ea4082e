use super::*;

fn load(toml: &str, env: &[(&str, &str)]) -> Result<RelayConfig, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(&file, toml).unwrap();
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    RelayConfig::load_with_env(&file, env)
}

const MINIMAL: &str = "[kafka]\nbrokers = [\"127.0.0.1:9092\"]\n";

mod outboxes;
mod transforms;

#[test]
fn minimal_file_gets_defaults() {
    let cfg = load(MINIMAL, &[]).unwrap();
    assert_eq!(cfg.source.mode, SourceMode::Replication);
    assert_eq!(cfg.outbox.table, "outbox_events");
    assert_eq!(cfg.polling.batch_size, DEFAULT_POLL_BATCH_SIZE);
    assert_eq!(cfg.kafka.message_timeout_ms, DEFAULT_KAFKA_MESSAGE_TIMEOUT_MS);
}

#[test]
fn a_misspelt_key_gets_the_closest_known_one() {
    let err = load(&format!("{MINIMAL}lingr_ms = 3\n"), &[]).unwrap_err().to_string();
    assert!(err.contains("did you mean `linger_ms`?"), "{err}");
    let err = load(&format!("{MINIMAL}[postgres]\npasword_file = \"/x\"\n"), &[]).unwrap_err().to_string();
    assert!(
        err.starts_with("postgres.pasword_file: unknown setting; did you mean `password_file`?"),
        "{err}"
    );
    let err = load(&format!("{MINIMAL}[replicaton]\nslot = \"s\"\n"), &[]).unwrap_err().to_string();
    assert!(err.contains("did you mean `replication`?"), "{err}");
    // nothing close: no guess
    let err = load(&format!("{MINIMAL}[sink]\n"), &[]).unwrap_err().to_string();
    assert!(!err.contains("did you mean"), "{err}");
}

#[test]
fn an_override_with_single_underscores_is_refused_naming_the_right_variable() {
    let err = load(MINIMAL, &[("OUTBOX_RELAY_POSTGRES_PASSWORD", "SENTINEL")]).unwrap_err().to_string();
    assert!(err.contains("OUTBOX_RELAY_POSTGRES_PASSWORD is not read"), "{err}");
    assert!(err.contains("set OUTBOX_RELAY__POSTGRES__PASSWORD instead"), "{err}");
    assert!(!err.contains("SENTINEL"), "{err}");
    let err = load(MINIMAL, &[("OUTBOX_RELAY_DEAD_LETTER_ON_POISON", "block")]).unwrap_err().to_string();
    assert!(err.contains("OUTBOX_RELAY__DEAD_LETTER__ON_POISON"), "{err}");
    // the relay's other variables, the secret Kafka form and the right form are not refused
    for name in [
        "OUTBOX_RELAY_LOG",
        "OUTBOX_RELAY_CONFIG",
        "OUTBOX_RELAY_TEST_PG_URL",
        "OUTBOX_RELAY__POSTGRES__PASSWORD",
    ] {
        assert!(load(MINIMAL, &[(name, "x")]).is_ok(), "{name}");
    }
    assert!(load(MINIMAL, &[("OUTBOX_RELAY_KAFKA_SASL_PASSWORD", "x")]).is_ok());
    // nor the variables Kubernetes sets for a Service named outbox-relay-polling (or -postgres)
    for name in [
        "OUTBOX_RELAY_POLLING_SERVICE_HOST",
        "OUTBOX_RELAY_POLLING_SERVICE_PORT",
        "OUTBOX_RELAY_POLLING_SERVICE_PORT_METRICS",
        "OUTBOX_RELAY_POLLING_PORT",
        "OUTBOX_RELAY_POLLING_PORT_9187_TCP",
        "OUTBOX_RELAY_POSTGRES_PORT_9187_TCP_ADDR",
        "OUTBOX_RELAY_POSTGRES_SERVICE_HOST",
    ] {
        assert!(load(MINIMAL, &[(name, "10.0.0.1")]).is_ok(), "{name}");
    }
}

#[test]
fn unknown_key_names_its_path() {
    let err = load(&format!("{MINIMAL}lingr_ms = 3\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("kafka.lingr_ms: unknown setting"), "{err}");
    let err = load(&format!("{MINIMAL}[polling]\nbatchsize = 3\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("polling.batchsize: unknown setting"), "{err}");
    let err = load(&format!("{MINIMAL}[sink]\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("sink: unknown setting"), "{err}");
}

#[test]
fn empty_broker_list_is_refused() {
    let err = load("[kafka]\nbrokers = []\n", &[]).unwrap_err().to_string();
    assert_eq!(err, "kafka.brokers: must not be empty");
    let err = load("[kafka]\nbrokers = [\"nohost\"]\n", &[]).unwrap_err().to_string();
    assert!(err.starts_with("kafka.brokers[0]: "), "{err}");
}

#[test]
fn missing_kafka_section_is_named() {
    let err = load("[postgres]\nport = 5432\n", &[]).unwrap_err().to_string();
    assert_eq!(err, "kafka: is required");
}

#[test]
fn bad_number_names_its_path() {
    let err = load(&format!("{MINIMAL}[polling]\nbatch_size = \"many\"\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("polling.batch_size: "), "{err}");
    let err = load(&format!("{MINIMAL}[postgres]\nport = 70000\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("postgres.port: "), "{err}");
    let err = load(&format!("{MINIMAL}[polling]\nbatch_size = 0\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("polling.batch_size: must be between"), "{err}");
}

#[test]
fn environment_overrides_file() {
    let cfg = load(
        MINIMAL,
        &[
            ("OUTBOX_RELAY__KAFKA__BROKERS", "a:1,b:2"),
            ("OUTBOX_RELAY__POLLING__BATCH_SIZE", "42"),
            ("OUTBOX_RELAY__SOURCE__MODE", "polling"),
            ("OUTBOX_RELAY__POSTGRES__PASSWORD", "12345"),
            ("UNRELATED", "x"),
        ],
    )
    .unwrap();
    assert_eq!(cfg.kafka.brokers, vec!["a:1", "b:2"]);
    assert_eq!(cfg.polling.batch_size, 42);
    assert_eq!(cfg.source.mode, SourceMode::Polling);
    assert_eq!(cfg.postgres.password.unwrap().expose(), "12345");
}

#[test]
fn bad_environment_number_names_its_path() {
    let err = load(MINIMAL, &[("OUTBOX_RELAY__POLLING__BATCH_SIZE", "lots")]).unwrap_err().to_string();
    assert!(err.starts_with("polling.batch_size: "), "{err}");
}

#[test]
fn delivery_guarantee_settings_cannot_be_overridden() {
    for key in ["acks", "enable.idempotence", "bootstrap.servers"] {
        let toml = format!("{MINIMAL}[kafka.properties]\n\"{key}\" = \"1\"\n");
        let err = load(&toml, &[]).unwrap_err().to_string();
        assert!(err.starts_with(&format!("kafka.properties.\"{key}\": may not be set")), "{err}");
    }
    let toml = format!("{MINIMAL}[kafka.properties]\n\"socket.timeout.ms\" = \"1000\"\n");
    let cfg = load(&toml, &[]).unwrap();
    assert_eq!(cfg.kafka.properties["socket.timeout.ms"].0, "1000");
}

#[test]
fn secrets_are_redacted() {
    let toml = format!(
        "{MINIMAL}[kafka.properties]\n\"sasl.password\" = \"hunter2\"\n[postgres]\npassword = \"pgsecret\"\n"
    );
    let cfg = load(&toml, &[]).unwrap();
    let shown = format!("{} {:?}", cfg.redacted(), cfg);
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(!shown.contains("pgsecret"), "{shown}");
    assert!(shown.contains("<redacted>"));
}

#[test]
fn topic_template_placeholders_are_checked() {
    let toml = format!("{MINIMAL}[outbox]\ntopic_template = \"events.{{aggregate}}\"\n");
    let err = load(&toml, &[]).unwrap_err().to_string();
    assert!(err.starts_with("outbox.topic_template: unknown placeholder {aggregate}"), "{err}");
}

#[test]
fn debezium_layout_is_expressible() {
    let toml = format!(
        "{MINIMAL}[outbox.columns]\naggregate_type = \"aggregatetype\"\naggregate_id = \"aggregateid\"\n\
         event_type = \"type\"\nheaders = \"\"\ntopic = \"\"\ncreated_at = \"\"\n"
    );
    let cfg = load(&toml, &[]).unwrap();
    assert!(cfg.outbox.columns.optional().is_empty());
    assert_eq!(cfg.outbox.columns.required()[2], ("aggregate_id", "aggregateid"));
}

#[test]
fn required_column_cannot_be_switched_off() {
    let toml = format!("{MINIMAL}[outbox.columns]\npayload = \"\"\n");
    let err = load(&toml, &[]).unwrap_err().to_string();
    assert!(err.starts_with("outbox.columns.payload: must not be empty"), "{err}");
}

#[test]
fn example_file_is_valid_and_matches_the_defaults() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/relay.example.toml");
    let example = RelayConfig::load_with_env(&path, Default::default()).unwrap();
    let defaults = load(MINIMAL, &[]).unwrap();
    let mut example = example.redacted();
    let mut defaults = defaults.redacted();
    // the example names a broker of its own; everything else must be the documented default
    example["kafka"]["brokers"] = serde_json::Value::Null;
    defaults["kafka"]["brokers"] = serde_json::Value::Null;
    assert_eq!(example, defaults);
}

#[test]
fn example_file_documents_every_option() {
    fn leaves(prefix: &str, value: &serde_json::Value, out: &mut Vec<String>) {
        match value.as_object() {
            Some(map) if prefix != "kafka.properties" => {
                for (k, v) in map {
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    leaves(&path, v, out);
                }
            }
            _ => out.push(prefix.to_string()),
        }
    }
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/relay.example.toml"),
    )
    .unwrap();
    let mut paths = Vec::new();
    leaves("", &load(MINIMAL, &[]).unwrap().redacted(), &mut paths);
    for path in paths.iter().filter(|p| *p != "kafka.properties") {
        let (section, key) = path.rsplit_once('.').unwrap();
        let section_at =
            text.find(&format!("[{section}]\n")).unwrap_or_else(|| panic!("no [{section}] section"));
        let body = &text[section_at..];
        let body = &body[..body[1..].find("\n[").map_or(body.len(), |i| i + 1)];
        assert!(
            body.contains(&format!("\n{key} = ")) || body.contains(&format!("\n# {key} = ")),
            "deploy/relay.example.toml does not document {path}"
        );
    }
}

#[test]
fn dead_letter_settings_have_their_own_section() {
    let cfg =
        load(&format!("{MINIMAL}[dead_letter]\non_poison = \"block\"\ntable = \"ops.dead\"\n"), &[]).unwrap();
    assert_eq!(cfg.dead_letter.on_poison, OnPoison::Block);
    assert_eq!(cfg.dead_letter.schema_and_table(), ("ops", "dead"));
    assert!(cfg.deprecations.is_empty());
    let cfg = load(MINIMAL, &[]).unwrap();
    assert_eq!(cfg.dead_letter.schema_and_table(), ("public", "outbox_dead_letter"));
    let err = load(&format!("{MINIMAL}[dead_letter]\ntable = \"a.b.c\"\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("dead_letter.table: "), "{err}");
}

#[test]
fn deprecated_polling_keys_still_load_with_a_warning() {
    let old = format!("{MINIMAL}[polling]\non_poison = \"block\"\ndead_letter_table = \"dl\"\n");
    let cfg = load(&old, &[]).unwrap();
    assert_eq!(cfg.dead_letter.on_poison, OnPoison::Block);
    assert_eq!(cfg.dead_letter.table, "public.dl");
    assert_eq!(cfg.deprecations.len(), 2, "{:?}", cfg.deprecations);
    assert!(cfg.deprecations[0].contains("dead_letter.on_poison"), "{:?}", cfg.deprecations);
    // the redacted view (and so `validate`) shows the setting in its new place only
    assert!(cfg.redacted()["polling"].get("on_poison").is_none());
    // the environment reaches the old place too
    let cfg = load(MINIMAL, &[("OUTBOX_RELAY__POLLING__ON_POISON", "block")]).unwrap();
    assert_eq!(cfg.dead_letter.on_poison, OnPoison::Block);
    // both places, disagreeing: refused, naming the old one
    let both =
        format!("{MINIMAL}[polling]\non_poison = \"dead_letter\"\n[dead_letter]\non_poison = \"block\"\n");
    let err = load(&both, &[]).unwrap_err().to_string();
    assert!(err.starts_with("polling.on_poison: deprecated and in conflict"), "{err}");
}

#[test]
fn kafka_secrets_come_from_a_file_and_the_environment_and_are_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let secrets = dir.path().join("kafka.properties");
    std::fs::write(
        &secrets,
        "# from a Secret\nsasl.password = SENTINEL-FILE\nssl.key.password=SENTINEL-KEY\n",
    )
    .unwrap();
    let toml = format!("{MINIMAL}secret_properties_file = \"{}\"\n", secrets.display());
    let cfg = load(&toml, &[("OUTBOX_RELAY_KAFKA_SASL_USERNAME", "relay")]).unwrap();
    let props: std::collections::BTreeMap<&str, &str> = cfg.kafka.client_properties().collect();
    assert_eq!(props["sasl.password"], "SENTINEL-FILE");
    assert_eq!(props["ssl.key.password"], "SENTINEL-KEY");
    assert_eq!(props["sasl.username"], "relay");
    let shown = cfg.redacted().to_string();
    assert!(!shown.contains("SENTINEL"), "{shown}");
    assert!(shown.contains("sasl.password"), "the key is shown, the value is not: {shown}");
    // a bad line is refused without quoting it
    std::fs::write(&secrets, "SENTINEL-NO-EQUALS\n").unwrap();
    let err = load(&toml, &[]).unwrap_err().to_string();
    assert!(err.starts_with("kafka.secret_properties_file: line 1") && !err.contains("SENTINEL"), "{err}");
    // and the relay's own settings cannot be overridden from there
    let err = load(MINIMAL, &[("OUTBOX_RELAY_KAFKA_ACKS", "1")]).unwrap_err().to_string();
    assert!(err.contains("\"acks\"") && err.contains("may not be set"), "{err}");
}

#[test]
fn errors_never_quote_a_secret() {
    // a TOML syntax error on the password's line
    let err = load("[postgres]\npassword = \"SENTINEL-PW\n[kafka]\nbrokers = [\"a:1\"]\n", &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 2") && !err.contains("SENTINEL"), "{err}");
    // a secret of the wrong type
    let err = load(&format!("{MINIMAL}[kafka.properties]\n\"sasl.password\" = [\"SENTINEL\"]\n"), &[])
        .unwrap_err()
        .to_string();
    assert!(!err.contains("SENTINEL"), "{err}");
    let err =
        load(&format!("{MINIMAL}[postgres]\npassword = [\"SENTINEL\"]\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("postgres.password: ") && !err.contains("SENTINEL"), "{err}");
}

#[test]
fn what_the_binary_was_not_built_for_is_refused_naming_the_setting() {
    let err = load(&format!("{MINIMAL}[kafka.properties]\n\"security.protocol\" = \"SASL_SSLX\"\n"), &[])
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("kafka.properties.\"security.protocol\""), "{err}");
    let err = load(&format!("{MINIMAL}[kafka.properties]\n\"sasl.mechanisms\" = \"GSSAPI\"\n"), &[])
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("kafka.properties.\"sasl.mechanisms\"") && err.contains("gssapi"), "{err}");
    for ok in ["SASL_SSL", "SSL", "SASL_PLAINTEXT"] {
        load(&format!("{MINIMAL}[kafka.properties]\n\"security.protocol\" = \"{ok}\"\n\"sasl.mechanisms\" = \"SCRAM-SHA-512\"\n"), &[])
            .unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    load(&MINIMAL.replace("brokers", "compression = \"zstd\"\nbrokers"), &[]).unwrap();
}

#[test]
fn postgres_host_takes_a_list_of_servers_in_order() {
    let cfg = load(&format!("{MINIMAL}[postgres]\nhost = \"pg-0:5433, pg-1\"\nport = 6000\n"), &[]).unwrap();
    let endpoints: Vec<String> = cfg.postgres.endpoints().iter().map(Endpoint::to_string).collect();
    assert_eq!(endpoints, ["pg-0:5433", "pg-1:6000"]);
    let cfg = load(&format!("{MINIMAL}[postgres]\nhost = \"[::1]:5433,[fd00::2],::3\"\n"), &[]).unwrap();
    let hosts: Vec<(String, u16)> = cfg.postgres.endpoints().into_iter().map(|e| (e.host, e.port)).collect();
    assert_eq!(hosts, [("::1".into(), 5433), ("fd00::2".into(), 5432), ("::3".into(), 5432)]);
    let env = [("OUTBOX_RELAY__POSTGRES__HOST", "a,b:1")];
    let cfg = load(MINIMAL, &env).unwrap();
    assert_eq!(cfg.postgres.endpoints().len(), 2);
    for bad in ["pg-0,", "pg-0:x", "pg-0:0", ":5432", "[::1", "[::1]x"] {
        let err = load(&format!("{MINIMAL}[postgres]\nhost = \"{bad}\"\n"), &[]).unwrap_err().to_string();
        assert!(err.starts_with("postgres.host: ") && err.contains("comma-separated"), "{bad}: {err}");
    }
}

#[test]
fn an_invalid_enum_value_lists_the_valid_ones() {
    let err = load(&format!("{MINIMAL}[source]\nmode = \"logical\"\n"), &[]).unwrap_err().to_string();
    assert!(err.contains("source.mode: \"logical\" is not a valid value"), "{err}");
    assert!(err.contains("`replication` or `polling`"), "{err}");
    let err = load(&format!("{MINIMAL}[postgres]\nsslmode = \"on\"\n"), &[]).unwrap_err().to_string();
    assert!(
        err.contains("postgres.sslmode: \"on\" is not a valid value; it must be one of `disable`"),
        "{err}"
    );
}

#[test]
fn a_bad_environment_override_names_the_variable() {
    let err = load(MINIMAL, &[("OUTBOX_RELAY__POLLING__BATCH_SIZE", "ten")]).unwrap_err().to_string();
    assert!(err.contains("polling.batch_size") && err.contains("OUTBOX_RELAY__POLLING__BATCH_SIZE"), "{err}");
    // an enum from the environment: the variable and the valid values
    let err = load(MINIMAL, &[("OUTBOX_RELAY__SOURCE__MODE", "logical")]).unwrap_err().to_string();
    assert!(
        err.contains("OUTBOX_RELAY__SOURCE__MODE") && err.contains("replication") && err.contains("polling"),
        "{err}"
    );
}

#[test]
fn the_default_sslmode_is_verify_full_and_verify_ca_needs_a_root() {
    assert_eq!(load(MINIMAL, &[]).unwrap().postgres.sslmode, SslMode::VerifyFull);
    let err = load(&format!("{MINIMAL}[postgres]\nsslmode = \"verify-ca\"\n"), &[]).unwrap_err().to_string();
    assert!(err.starts_with("postgres.sslmode: verify-ca needs postgres.sslrootcert"), "{err}");
}

#[test]
fn a_property_librdkafka_refuses_is_named_without_its_value() {
    for (key, problem) in [("sasl.pasword", "no such property"), ("enable.idempotence.x", "no such property")]
    {
        let toml = format!("{MINIMAL}[kafka.properties]\n\"{key}\" = \"SENTINEL-V\"\n");
        let err = load(&toml, &[]).unwrap_err().to_string();
        assert!(err.starts_with(&format!("kafka.properties.\"{key}\": librdkafka has {problem}")), "{err}");
        assert!(!err.contains("SENTINEL"), "{err}");
    }
    let toml = format!("{MINIMAL}[kafka.properties]\n\"socket.keepalive.enable\" = \"SENTINEL-V\"\n");
    let err = load(&toml, &[]).unwrap_err().to_string();
    assert!(err.contains("librdkafka refuses the value (not shown") && !err.contains("SENTINEL"), "{err}");
    // from the environment, the same
    let err = load(MINIMAL, &[("OUTBOX_RELAY_KAFKA_SASL_PASWORD", "SENTINEL-V")]).unwrap_err().to_string();
    assert!(
        err.contains("\"sasl.pasword\": librdkafka has no such property") && !err.contains("SENTINEL"),
        "{err}"
    );
}

#[cfg(unix)]
#[test]
fn a_secret_file_others_can_read_is_a_start_up_warning() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pw");
    std::fs::write(&file, "x\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let toml = format!("{MINIMAL}[postgres]\npassword_file = \"{}\"\n", file.display());
    let cfg = load(&toml, &[]).unwrap();
    assert!(
        cfg.deprecations.iter().any(|w| w.starts_with("postgres.password_file")),
        "{:?}",
        cfg.deprecations
    );
}

#[test]
fn kafka_transaction_settings_are_checked_naming_the_key() {
    let refused = |extra: &str| load(&format!("{MINIMAL}{extra}"), &[]).unwrap_err().to_string();
    let err = refused("transactional = true\nmessage_timeout_ms = 120000\n");
    assert!(
        err.starts_with("kafka.message_timeout_ms:") && err.contains("transaction_timeout_ms (60000)"),
        "{err}"
    );
    let err = refused("transactional_id = \"two words\"\n");
    assert!(err.starts_with("kafka.transactional_id:"), "{err}");
    let err = refused("transaction_timeout_ms = 500\n");
    assert!(err.starts_with("kafka.transaction_timeout_ms:"), "{err}");
    let err = refused("transaction_max_ms = 40000\n");
    assert!(err.starts_with("kafka.transaction_max_ms:") && err.contains("half"), "{err}");
    let err = refused("transaction_max_events = 0\n");
    assert!(err.starts_with("kafka.transaction_max_events:"), "{err}");
    let err = refused("[kafka.properties]\n\"transactional.id\" = \"x\"\n");
    assert!(err.contains("\"transactional.id\"") && err.contains("kafka.transactional"), "{err}");
    // without transactions a long message timeout is no conflict; with them 0 is "until the
    // transaction timeout"
    assert!(load(&format!("{MINIMAL}message_timeout_ms = 120000\n"), &[]).is_ok());
    assert!(load(&format!("{MINIMAL}transactional = true\n"), &[]).is_ok());
}
