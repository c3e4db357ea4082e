{{- /*
Helpers of the outbox-relay chart. The objects are the kustomize base's (files/base links to
deploy/kubernetes and deploy/verify-watch), read with fromYaml and given per-database names,
labels, configuration and Secrets here, so that the chart and the base cannot drift apart.
*/ -}}

{{- /* The base's object `file` (a name under files/base/), parsed. */ -}}
{{- define "outbox-relay.base" -}}
{{- $.root.Files.Get (printf "files/base/%s" $.file) | required (printf "files/base/%s is missing from the chart" $.file) -}}
{{- end -}}

{{- /* The image every container runs: repository:tag[@digest]. */ -}}
{{- define "outbox-relay.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- .Values.image.repository }}:{{ $tag }}{{ with .Values.image.digest }}@{{ . }}{{ end }}
{{- end -}}

{{- /* The labels of one database's objects: dict root, instance, component. */ -}}
{{- define "outbox-relay.labels" -}}
{{ include "outbox-relay.selector" . }}
app.kubernetes.io/part-of: outbox-relay
app.kubernetes.io/version: {{ .root.Values.image.tag | default .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- /* The labels selectors use: those that never change for a pod. */ -}}
{{- define "outbox-relay.selector" -}}
app.kubernetes.io/name: outbox-relay
app.kubernetes.io/instance: {{ .instance }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- /*
One database's settings, worked out once (dict root, db, index): returned as JSON, read with
fromJson. `config` is the relay's configuration: the base's relay.toml, under the chart's
`config`, under the database's `config`, with what must differ per database set last.
*/ -}}
{{- define "outbox-relay.database" -}}
{{- $root := .root -}}
{{- $db := .db -}}
{{- $path := printf "databases[%d]" (int .index) -}}
{{- $name := $db.name | required (printf "%s.name: every database needs a name" $path) -}}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9-]*[a-z0-9])?$" $name) -}}
{{- fail (printf "%s.name: %q is not a DNS label (lowercase letters, digits, '-')" $path $name) -}}
{{- end -}}
{{- $fullname := printf "%s-%s" $root.Release.Name $name -}}
{{- if gt (len $fullname) 45 -}}
{{- fail (printf "%s.name: %q makes object names of %d characters (<release>-<name>, at most 45: a StatefulSet's pods carry a 63-character label of it)" $path $fullname (len $fullname)) -}}
{{- end -}}
{{- $baseMap := include "outbox-relay.base" (dict "root" $root "file" "configmap.yaml") | fromYaml -}}
{{- $config := index $baseMap "data" "relay.toml" | fromToml -}}
{{- $config = mustMergeOverwrite $config (deepCopy ($root.Values.config | default dict)) (deepCopy ($db.config | default dict)) -}}
{{- $section := dict -}}
{{- range $key := list "source" "postgres" "replication" "polling" "kafka" "metrics" -}}
{{- $_ := set $section $key (get $config $key | default dict) -}}
{{- $_ := set $config $key (get $section $key) -}}
{{- end -}}
{{- $slot := $db.slot | default (printf "outbox_relay_%s" ($name | replace "-" "_")) -}}
{{- $_ := set $section.source "mode" ($db.mode | default "replication") -}}
{{- $_ := set $section.postgres "database" ($db.database | default $name) -}}
{{- $_ := set $section.replication "slot" $slot -}}
{{- $lockKey := $db.leaderLockKey | default (printf "outbox-relay/%s" $name | adler32sum) | int64 -}}
{{- $_ := set $section.polling "leader_lock_key" $lockKey -}}
{{- $clientId := $db.clientId | default (printf "outbox-relay-%s" $name) -}}
{{- $_ := set $section.kafka "client_id" $clientId -}}
{{- if $db.outboxes -}}
{{- $_ := set $config "outboxes" $db.outboxes -}}
{{- $_ := unset $config "outbox" -}}
{{- end -}}
{{- $admin := $db.admin | default dict -}}
{{- if $admin.enabled -}}
{{- $_ := set $config "admin" (mustMergeOverwrite (deepCopy ($admin.config | default dict)) (dict "listen" (printf "0.0.0.0:%d" (int ($admin.port | default 9189))))) -}}
{{- end -}}
{{- $metricsPort := $section.metrics.listen | default "0.0.0.0:9187" | splitList ":" | last | int -}}
{{- $egress := list 53 (int ($section.postgres.port | default 5432)) -}}
{{- range $broker := $section.kafka.brokers | default list -}}
{{- $egress = append $egress ($broker | splitList ":" | last | int) -}}
{{- end -}}
{{- range $port := $root.Values.networkPolicy.extraEgressPorts | default list -}}
{{- $egress = append $egress (int $port) -}}
{{- end -}}
{{- $setup := mustMergeOverwrite (dict "enabled" true "hook" "pre-install" "ownerUser" "app_owner" "ownerSecret" "") (deepCopy ($db.setup | default dict)) -}}
{{- $verify := mustMergeOverwrite (dict "enabled" false "secret" "" "since" "15m" "everySecs" 60 "resources" dict) (deepCopy ($db.verify | default dict)) -}}
{{- dict
  "name" $name "path" $path "fullname" $fullname "instance" $fullname "slot" $slot
  "lockKey" $lockKey "clientId" $clientId "transactionalId" ($section.kafka.transactional_id | default "")
  "mode" $section.source.mode "secret" ($db.secret | default $fullname)
  "ownerSecret" ($setup.ownerSecret | default (printf "%s-owner" $fullname))
  "verifySecret" ($verify.secret | default (printf "%s-verify" $fullname))
  "setup" $setup "verify" $verify "admin" $admin "resources" ($db.resources | default dict)
  "metricsPort" $metricsPort "egressPorts" ($egress | uniq) "config" $config
  | toJson -}}
{{- end -}}

{{- /* Every database's settings, checked for what must differ between them: a JSON list. */ -}}
{{- define "outbox-relay.databases" -}}
{{- $all := list -}}
{{- $seen := dict -}}
{{- range $index, $db := .Values.databases | required "databases: list at least one database" -}}
{{- $d := include "outbox-relay.database" (dict "root" $ "db" $db "index" $index) | fromJson -}}
{{- range $field := list "name" "slot" "lockKey" "clientId" "transactionalId" -}}
{{- $value := toString (get $d $field) -}}
{{- if $value -}}
{{- $key := printf "%s=%s" $field $value -}}
{{- with get $seen $key -}}
{{- fail (printf "%s and %s share the %s %q: every database needs its own (a slot, the polling leader lock, the Kafka client id and transactional id belong to one relay)" . $d.path (include "outbox-relay.fieldName" $field) $value) -}}
{{- end -}}
{{- $_ := set $seen $key $d.path -}}
{{- end -}}
{{- end -}}
{{- $all = append $all $d -}}
{{- end -}}
{{- $all | toJson -}}
{{- end -}}

{{- define "outbox-relay.fieldName" -}}
{{- get (dict "name" "name" "slot" "slot (replication.slot)" "lockKey" "leaderLockKey (polling.leader_lock_key)" "clientId" "clientId (kafka.client_id)" "transactionalId" "kafka.transactional_id") . -}}
{{- end -}}

{{- /* One database's relay.toml (the dict of outbox-relay.database). */ -}}
{{- define "outbox-relay.configText" -}}
{{- include "outbox-relay.toml" (dict "table" .config "path" list) | trim -}}
{{- end -}}

{{- /*
A map as TOML (dict table, path: the keys above it): values first, then tables, then arrays
of tables. Helm reads the numbers of values files as floats: whole ones are written as integers.
*/ -}}
{{- define "outbox-relay.toml" -}}
{{- $table := .table -}}
{{- range $key := keys $table | sortAlpha -}}
{{- $value := get $table $key -}}
{{- if not (or (kindIs "map" $value) (include "outbox-relay.isTables" $value)) }}
{{ include "outbox-relay.tomlKey" $key }} = {{ include "outbox-relay.tomlValue" $value }}
{{- end -}}
{{- end -}}
{{- range $key := keys $table | sortAlpha -}}
{{- $value := get $table $key -}}
{{- $sub := append $.path (include "outbox-relay.tomlKey" $key) -}}
{{- if kindIs "map" $value }}

[{{ join "." $sub }}]
{{- include "outbox-relay.toml" (dict "table" $value "path" $sub) -}}
{{- else if include "outbox-relay.isTables" $value -}}
{{- range $item := $value }}

[[{{ join "." $sub }}]]
{{- include "outbox-relay.toml" (dict "table" $item "path" $sub) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "outbox-relay.isTables" -}}
{{- if and (kindIs "slice" .) . -}}{{- if kindIs "map" (first .) -}}true{{- end -}}{{- end -}}
{{- end -}}

{{- define "outbox-relay.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{- define "outbox-relay.tomlValue" -}}
{{- if kindIs "string" . -}}{{ toJson . }}
{{- else if kindIs "float64" . -}}{{ if eq . (float64 (int64 .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if kindIs "slice" . -}}[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "outbox-relay.tomlValue" $v }}{{ end }}]
{{- else if kindIs "invalid" . -}}{{ fail "a configuration value is null: remove the key instead" }}
{{- else -}}{{ . }}
{{- end -}}
{{- end -}}

{{- /*
A NetworkPolicy as the base's (deploy/kubernetes/networkpolicy.yaml): in, Prometheus to the
metrics port only; out, DNS and the given TCP ports (PostgreSQL's, Kafka's, the extra ones).
dict root, name, labels, selector, ports.
*/ -}}
{{- define "outbox-relay.networkPolicy" }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ .name }}
  labels: {{- .labels | nindent 4 }}
spec:
  podSelector:
    matchLabels: {{- toYaml .selector | nindent 6 }}
  policyTypes:
    - Ingress
    - Egress
  ingress:
    - from:
        - namespaceSelector:
            matchLabels:
              kubernetes.io/metadata.name: {{ .root.Values.networkPolicy.prometheusNamespace }}
          podSelector:
            matchLabels: {{- toYaml .root.Values.networkPolicy.prometheusPodLabels | nindent 14 }}
      ports:
        - protocol: TCP
          port: metrics
  egress:
    - to:
        - namespaceSelector:
            matchLabels:
              kubernetes.io/metadata.name: kube-system
          podSelector:
            matchLabels:
              k8s-app: kube-dns
      ports:
        - protocol: UDP
          port: 53
        - protocol: TCP
          port: 53
    # PostgreSQL, Kafka, and networkPolicy.extraEgressPorts, to any address
    {{- range $port := .ports }}
    {{- if ne (int $port) 53 }}
    - ports:
        - protocol: TCP
          port: {{ $port }}
    {{- end }}
    {{- end }}
{{- end -}}
