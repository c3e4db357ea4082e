#!/usr/bin/env python3
"""Reads a topic whose values are in the Confluent wire format and prints each record decoded by
Confluent's own Python client (confluent-kafka; Avro through fastavro), as one JSON line:
{"partition", "offset", "key", "id", "schema_id", "value"}. The tests compare these values with
the events they wrote, field by field: a decoder that is not the relay's.

    registry_consume.py BROKERS TOPIC REGISTRY_URL KIND COUNT [TIMEOUT_SECS]

KIND is avro or json. Reads from the start until COUNT records or TIMEOUT_SECS (60) pass.
"""
import json
import struct
import sys
import time
import uuid

from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.serialization import MessageField, SerializationContext


def main():
    brokers, topic, url, kind, count = sys.argv[1:6]
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 60.0
    registry = SchemaRegistryClient({"url": url})
    if kind == "avro":
        from confluent_kafka.schema_registry.avro import AvroDeserializer
        deserialize = AvroDeserializer(registry)
    elif kind == "json":
        from confluent_kafka.schema_registry.json_schema import JSONDeserializer
        deserialize = JSONDeserializer(None, schema_registry_client=registry)
    else:
        sys.exit(f"unknown kind {kind}")
    consumer = Consumer({
        "bootstrap.servers": brokers,
        "group.id": f"registry-consume-{uuid.uuid4()}",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
    })
    consumer.subscribe([topic])
    seen, deadline = 0, time.monotonic() + timeout
    while seen < int(count) and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is None:
            continue
        if message.error():
            sys.exit(f"consume: {message.error()}")
        value = message.value()
        headers = dict((k, v.decode()) for k, v in (message.headers() or []) if v is not None)
        decoded = deserialize(value, SerializationContext(topic, MessageField.VALUE))
        print(json.dumps({
            "partition": message.partition(),
            "offset": message.offset(),
            "key": message.key().decode() if message.key() else None,
            "id": headers.get("id"),
            "schema_id": struct.unpack(">bI", value[:5])[1],
            "value": decoded,
        }), flush=True)
        seen += 1
    consumer.close()


if __name__ == "__main__":
    main()
