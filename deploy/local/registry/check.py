#!/usr/bin/env python3
"""End-to-end check of a running Confluent-compatible schema registry with an independent
client: Confluent's own Python client (confluent-kafka with its avro, json and protobuf extras).

    python3 deploy/local/registry/check.py [--url URL] [--cacert CA] [--basic-auth USER:PASS]

Defaults come from the environment start_registry exports: OUTBOX_RELAY_TEST_REGISTRY_URL,
OUTBOX_RELAY_TEST_REGISTRY_CA, OUTBOX_RELAY_TEST_REGISTRY_USER and _PASSWORD. Needs
    python3 -m pip install 'confluent-kafka[avro,json,protobuf]'
No Kafka broker: the serializers run with a SerializationContext alone. Each check prints one
line; the last line says how many passed and failed; the exit status is 1 if any failed.
Subjects get a random prefix, so the check can run against a registry that tests also use.

What it shows (README.md has the raw requests):
  - SchemaRegistryClient registers Avro, JSON Schema and Protobuf schemas and reads them back by
    id, by subject (latest) and by content (lookup);
  - the ids are Confluent's: the same schema gets the same id in every subject, and
    /schemas/ids/{id} of an id from a registration returns that schema;
  - AvroSerializer/AvroDeserializer, JSONSerializer/JSONDeserializer and
    ProtobufSerializer/ProtobufDeserializer round-trip a record through the Confluent wire format
    (magic byte 0, big-endian 4-byte id; Protobuf adds the message indexes), the deserializer
    using a fresh client, so it fetches the writer's schema by id from the registry (Protobuf:
    /schemas/ids/{id}?format=serialized, which Apicurio 3.3.3 gets wrong: README.md);
  - a .proto text registered as the relay would, and a payload framed by hand, decode with
    Confluent's ProtobufDeserializer (given the message class, no registry look-up);
  - BACKWARD compatibility is enforced: an incompatible Avro schema is refused with HTTP 409 /
    error code 409, and a compatible one becomes version 2;
  - unknown subject, version and id answer 404 with error codes 40401, 40402 and 40403.
"""
import argparse
import json
import os
import struct
import sys
import traceback
import uuid

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

AVRO_V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "outbox.check",
    "fields": [{"name": "id", "type": "long"}, {"name": "customer", "type": "string"}],
}
# BACKWARD-compatible: a new field with a default
AVRO_V2 = dict(AVRO_V1, fields=AVRO_V1["fields"] + [{"name": "note", "type": "string", "default": ""}])
# BACKWARD-incompatible: a new field without a default
AVRO_BAD = dict(AVRO_V1, fields=AVRO_V1["fields"] + [{"name": "must", "type": "string"}])
JSON_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Order",
    "type": "object",
    "properties": {"id": {"type": "integer"}, "customer": {"type": "string"}},
    "required": ["id"],
}
PROTO_TEXT = 'syntax = "proto3";\npackage outbox.check;\n\nmessage Row {\n  int64 id = 1;\n  string name = 2;\n}\n'


class Checks:
    def __init__(self, conf):
        self.conf = conf
        self.client = SchemaRegistryClient(conf)
        self.prefix = "check-" + uuid.uuid4().hex[:8]
        self.passed = 0
        self.failed = 0

    def fresh(self):
        """A client with empty caches: what it returns came from the registry."""
        return SchemaRegistryClient(self.conf)

    def run(self, name, fn):
        try:
            detail = fn()
        except Exception as e:  # a failed check is reported, the others still run
            self.failed += 1
            print(f"FAIL {name}: {e!r}")
            traceback.print_exc(limit=3, file=sys.stdout)
        else:
            self.passed += 1
            print(f"ok   {name}{': ' + detail if detail else ''}")

    def subject(self, name):
        return f"{self.prefix}-{name}"


def expect_error(fn, status, code):
    try:
        fn()
    except SchemaRegistryError as e:
        if e.http_status_code != status or e.error_code != code:
            raise AssertionError(f"expected HTTP {status} / {code}, got HTTP {e.http_status_code} / {e.error_code}: {e.error_message}")
        return f"HTTP {e.http_status_code}, error_code {e.error_code} ({e.error_message})"
    raise AssertionError(f"expected HTTP {status} / {code}, the call succeeded")


def wire(data):
    """(magic byte, schema id) of a Confluent-framed value."""
    assert len(data) >= 5, data
    magic, schema_id = struct.unpack(">bI", data[:5])
    return magic, schema_id


def proto_message_class():
    """The Row message of PROTO_TEXT, built at run time (no protoc here)."""
    fdp = descriptor_pb2.FileDescriptorProto(name="outbox_check_row.proto", package="outbox.check", syntax="proto3")
    msg = fdp.message_type.add(name="Row")
    msg.field.add(name="id", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL, json_name="id")
    msg.field.add(name="name", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL, json_name="name")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("outbox.check.Row"))


def main():
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=env("OUTBOX_RELAY_TEST_REGISTRY_URL"))
    p.add_argument("--cacert", default=env("OUTBOX_RELAY_TEST_REGISTRY_CA"))
    default_auth = None
    if env("OUTBOX_RELAY_TEST_REGISTRY_USER"):
        default_auth = f"{env('OUTBOX_RELAY_TEST_REGISTRY_USER')}:{env('OUTBOX_RELAY_TEST_REGISTRY_PASSWORD', '')}"
    p.add_argument("--basic-auth", default=default_auth, metavar="USER:PASS")
    a = p.parse_args()
    if not a.url:
        p.error("no --url and no OUTBOX_RELAY_TEST_REGISTRY_URL")
    # a request that gets no answer fails after 10 s and is retried (Apicurio 3.3.3 leaves some
    # requests to unknown paths unanswered: README.md)
    conf = {"url": a.url, "timeout": 10}
    if a.cacert:
        conf["ssl.ca.location"] = a.cacert
    if a.basic_auth:
        conf["basic.auth.user.info"] = a.basic_auth
    print(f"registry {a.url}{' (TLS, CA ' + a.cacert + ')' if a.cacert else ''}{' (basic auth)' if a.basic_auth else ''}")
    c = Checks(conf)
    orders = c.subject("orders-value")
    state = {}

    def avro_register():
        schema = Schema(json.dumps(AVRO_V1), "AVRO")
        schema_id = c.client.register_schema(orders, schema)
        again = c.fresh().register_schema(orders, schema)
        assert again == schema_id, f"registering the same schema again gave id {again}, not {schema_id}"
        state["avro_id"] = schema_id
        return f"id {schema_id} (the same on a second registration)"

    def avro_get_by_id():
        got = c.fresh().get_schema(state["avro_id"])
        assert got.schema_type == "AVRO", got.schema_type
        assert json.loads(got.schema_str) == AVRO_V1, got.schema_str
        return f"GET /schemas/ids/{state['avro_id']} returns the schema"

    def avro_lookup():
        reg = c.fresh().lookup_schema(orders, Schema(json.dumps(AVRO_V1), "AVRO"))
        assert (reg.schema_id, reg.version, reg.subject) == (state["avro_id"], 1, orders), reg
        # the same schema, formatted differently, is the same schema
        pretty = c.fresh().lookup_schema(orders, Schema(json.dumps(AVRO_V1, indent=2), "AVRO"))
        assert pretty.schema_id == state["avro_id"], pretty
        return f"POST /subjects/{orders} -> id {reg.schema_id}, version {reg.version} (also for a reformatted schema)"

    def avro_latest():
        reg = c.fresh().get_latest_version(orders)
        assert (reg.schema_id, reg.version) == (state["avro_id"], 1), reg
        return f"version {reg.version}, id {reg.schema_id}"

    def same_id_in_other_subject():
        other = c.fresh().register_schema(c.subject("other-value"), Schema(json.dumps(AVRO_V1), "AVRO"))
        assert other == state["avro_id"], f"id {other} in another subject, not {state['avro_id']}: ids are not content ids"
        return f"id {other} again: ids name schemas (Confluent's semantics), not subject versions"

    def avro_round_trip():
        ctx = SerializationContext(c.subject("orders"), MessageField.VALUE)
        ser = AvroSerializer(c.fresh(), json.dumps(AVRO_V1), conf={"auto.register.schemas": True})
        record = {"id": 42, "customer": "ACME"}
        data = ser(record, ctx)
        magic, schema_id = wire(data)
        assert magic == 0, magic
        # TopicNameStrategy: subject <topic>-value, the subject avro_register used
        assert schema_id == state["avro_id"], f"framed id {schema_id}, registered {state['avro_id']}"
        back = AvroDeserializer(c.fresh())(data, ctx)
        assert back == record, back
        return f"{len(data)} bytes {data.hex()} -> {back}"

    def compatibility():
        client = c.fresh()
        level = client.set_compatibility(orders, "BACKWARD")
        detail = expect_error(lambda: client.register_schema(orders, Schema(json.dumps(AVRO_BAD), "AVRO")), 409, 409)
        assert client.test_compatibility(orders, Schema(json.dumps(AVRO_BAD), "AVRO")) is False
        assert client.test_compatibility(orders, Schema(json.dumps(AVRO_V2), "AVRO")) is True
        v2 = client.register_schema(orders, Schema(json.dumps(AVRO_V2), "AVRO"))
        latest = c.fresh().get_latest_version(orders)
        assert (latest.version, latest.schema_id) == (2, v2), latest
        return f"PUT /config -> {level}; incompatible: {detail}; compatible: version 2, id {v2}"

    def not_found():
        client = c.fresh()
        subj = expect_error(lambda: client.get_latest_version(c.subject("no-such-subject")), 404, 40401)
        ver = expect_error(lambda: client.get_version(orders, 99), 404, 40402)
        sid = expect_error(lambda: client.get_schema(2**31 - 1), 404, 40403)
        return f"subject: {subj}; version: {ver}; id: {sid}"

    def json_round_trip():
        ctx = SerializationContext(c.subject("users"), MessageField.VALUE)
        ser = JSONSerializer(json.dumps(JSON_SCHEMA), c.fresh(), conf={"auto.register.schemas": True})
        record = {"id": 7, "customer": "Initech"}
        data = ser(record, ctx)
        magic, schema_id = wire(data)
        assert magic == 0, magic
        got = c.fresh().get_schema(schema_id)
        assert got.schema_type == "JSON" and json.loads(got.schema_str) == JSON_SCHEMA, got
        back = JSONDeserializer(None, schema_registry_client=c.fresh())(data, ctx)
        assert back == record, back
        return f"id {schema_id}, {len(data)} bytes -> {back}"

    def protobuf_relay_style():
        # what the relay does: register the .proto text, frame the payload itself (magic byte,
        # id, message indexes [0] as the single byte 0), and a consumer decodes it with the
        # message class it has, fetching the writer's schema by id only to look at it
        Row = proto_message_class()
        client = c.fresh()
        subject = c.subject("rows-value")
        schema_id = client.register_schema(subject, Schema(PROTO_TEXT, "PROTOBUF"))
        got = c.fresh().get_schema(schema_id)
        assert got.schema_type == "PROTOBUF", got.schema_type
        assert got.schema_str == PROTO_TEXT, got.schema_str
        data = struct.pack(">bI", 0, schema_id) + b"\x00" + Row(id=9, name="nine").SerializeToString()
        ctx = SerializationContext(c.subject("rows"), MessageField.VALUE)
        back = ProtobufDeserializer(Row, {})(data, ctx)
        assert (back.id, back.name) == (9, "nine"), back
        return f"id {schema_id}, {len(data)} bytes -> Row(id={back.id}, name={back.name!r})"

    def protobuf_confluent_round_trip():
        # Confluent's own Protobuf serde: the serializer registers the schema as a base64
        # FileDescriptorProto, the deserializer fetches /schemas/ids/{id}?format=serialized and
        # expects that base64 back
        Row = proto_message_class()
        ctx = SerializationContext(c.subject("rows-b64"), MessageField.VALUE)
        ser = ProtobufSerializer(Row, c.fresh(), conf={"auto.register.schemas": True})
        data = ser(Row(id=9, name="nine"), ctx)
        magic, schema_id = wire(data)
        assert magic == 0, magic
        assert data[5] == 0, f"message index: {data[5]} (0 is the first message)"
        back = ProtobufDeserializer(Row, schema_registry_client=c.fresh())(data, ctx)
        assert (back.id, back.name) == (9, "nine"), back
        return f"id {schema_id}, {len(data)} bytes -> Row(id={back.id}, name={back.name!r})"

    for name, fn in [
        ("avro: register", avro_register),
        ("avro: schema by id", avro_get_by_id),
        ("avro: lookup by content", avro_lookup),
        ("avro: latest version", avro_latest),
        ("ids: same schema, other subject", same_id_in_other_subject),
        ("avro: serializer/deserializer round trip", avro_round_trip),
        ("compatibility: BACKWARD enforced", compatibility),
        ("errors: not found", not_found),
        ("json schema: serializer/deserializer round trip", json_round_trip),
        ("protobuf: .proto text registered, framed payload decoded", protobuf_relay_style),
        ("protobuf: Confluent serializer/deserializer round trip (?format=serialized)", protobuf_confluent_round_trip),
    ]:
        c.run(name, fn)
    print(f"check.py: {c.passed} passed, {c.failed} failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
