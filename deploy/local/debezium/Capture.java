// Reads every record of one or more Kafka topics from the beginning and prints one JSON line
// per record, sorted by topic, partition and offset:
//
//   {"topic":"t","partition":0,"offset":0,"key_b64":"...","value_b64":"...",
//    "headers":[["id","..."]],"timestamp_type":"CreateTime","timestamp":1700000000000}
//
// key_b64, value_b64 and a header's value are the exact bytes, base64 (standard alphabet,
// padded), or null for a null key, value or header value. Headers keep their order in the record.
//
//   Capture --bootstrap HOST:PORT --topic T [--topic T2 ...] [--count N] [--timeout SECONDS]
//
// Stops once N records have been read (over all topics), or at the timeout (default 60 s). A
// topic that does not exist yet is waited for (never created). Exit 0 when N records were
// read, or with no --count when the timeout ends the read; 1 when fewer than N arrived (what
// did arrive is still printed); 2 on bad arguments. It reads read_committed, with no consumer
// group (partitions assigned by hand, nothing committed).
// deploy/local/debezium/capture compiles and runs it on the pinned kafka-clients.

import java.io.BufferedWriter;
import java.io.OutputStreamWriter;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Comparator;
import java.util.HashSet;
import java.util.List;
import java.util.Properties;
import java.util.Set;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

public class Capture {
    public static void main(String[] args) throws Exception {
        String bootstrap = null;
        List<String> topics = new ArrayList<>();
        long count = -1;
        double timeout = 60;
        for (int i = 0; i < args.length; i++) {
            String a = args[i];
            if (i + 1 >= args.length) usage("missing the value of " + a);
            switch (a) {
                case "--bootstrap": bootstrap = args[++i]; break;
                case "--topic": topics.add(args[++i]); break;
                case "--count": count = Long.parseLong(args[++i]); break;
                case "--timeout": timeout = Double.parseDouble(args[++i]); break;
                default: usage("unknown argument " + a);
            }
        }
        if (bootstrap == null || topics.isEmpty()) usage("--bootstrap and --topic are required");

        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(ConsumerConfig.CLIENT_ID_CONFIG, "outbox-relay-capture");
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        props.put(ConsumerConfig.ALLOW_AUTO_CREATE_TOPICS_CONFIG, "false");
        props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());

        long deadline = System.nanoTime() + (long) (timeout * 1e9);
        List<ConsumerRecord<byte[], byte[]>> records = new ArrayList<>();
        try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(props)) {
            Set<String> pending = new HashSet<>(topics);
            Set<TopicPartition> assigned = new HashSet<>();
            while (System.nanoTime() < deadline && (count < 0 || records.size() < count)) {
                // assign the partitions of the topics that exist by now, from their beginning
                if (!pending.isEmpty()) {
                    List<TopicPartition> added = new ArrayList<>();
                    for (String topic : new ArrayList<>(pending)) {
                        List<PartitionInfo> parts;
                        try {
                            parts = consumer.partitionsFor(topic, Duration.ofMillis(500));
                        } catch (Exception e) {
                            parts = null;
                        }
                        if (parts == null || parts.isEmpty()) continue;
                        for (PartitionInfo p : parts) added.add(new TopicPartition(topic, p.partition()));
                        pending.remove(topic);
                    }
                    if (!added.isEmpty()) {
                        assigned.addAll(added);
                        consumer.assign(assigned);
                        consumer.seekToBeginning(added);
                    }
                }
                if (assigned.isEmpty()) {
                    Thread.sleep(200);
                    continue;
                }
                for (ConsumerRecord<byte[], byte[]> r : consumer.poll(Duration.ofMillis(200))) records.add(r);
            }
        }

        records.sort(Comparator.<ConsumerRecord<byte[], byte[]>, String>comparing(ConsumerRecord::topic)
                .thenComparingInt(ConsumerRecord::partition)
                .thenComparingLong(ConsumerRecord::offset));
        BufferedWriter out = new BufferedWriter(new OutputStreamWriter(System.out, StandardCharsets.UTF_8));
        for (ConsumerRecord<byte[], byte[]> r : records) {
            StringBuilder s = new StringBuilder();
            s.append("{\"topic\":").append(str(r.topic()));
            s.append(",\"partition\":").append(r.partition());
            s.append(",\"offset\":").append(r.offset());
            s.append(",\"key_b64\":").append(b64(r.key()));
            s.append(",\"value_b64\":").append(b64(r.value()));
            s.append(",\"headers\":[");
            boolean first = true;
            for (Header h : r.headers()) {
                if (!first) s.append(',');
                first = false;
                s.append('[').append(str(h.key())).append(',').append(b64(h.value())).append(']');
            }
            s.append("],\"timestamp_type\":").append(str(r.timestampType().name));
            s.append(",\"timestamp\":").append(r.timestamp()).append('}');
            out.write(s.toString());
            out.write('\n');
        }
        out.flush();
        if (count >= 0 && records.size() < count) {
            System.err.println("capture: " + records.size() + " of " + count + " records within " + timeout + " s");
            System.exit(1);
        }
    }

    static String b64(byte[] bytes) {
        return bytes == null ? "null" : "\"" + Base64.getEncoder().encodeToString(bytes) + "\"";
    }

    // a JSON string (topic and header names)
    static String str(String v) {
        StringBuilder s = new StringBuilder("\"");
        for (char c : v.toCharArray()) {
            switch (c) {
                case '"': s.append("\\\""); break;
                case '\\': s.append("\\\\"); break;
                default:
                    if (c < 0x20) s.append(String.format("\\u%04x", (int) c));
                    else s.append(c);
            }
        }
        return s.append('"').toString();
    }

    static void usage(String why) {
        System.err.println("capture: " + why);
        System.err.println("usage: capture --bootstrap HOST:PORT --topic T [--topic T2 ...] [--count N] [--timeout SECONDS]");
        System.exit(2);
    }
}
