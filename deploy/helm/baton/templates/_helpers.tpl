{{/*
Names, labels and the pieces every Baton pod shares. Component helpers take a dict:
(dict "root" $ "component" "gateway"), plus "values", "image" and "podLabels" where they need them.
*/}}

{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>", or the release alone when it already contains the chart's name. */}}
{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<suffix>", the full name cut so that the whole stays a 63-character DNS label. */}}
{{- define "baton.componentName" -}}
{{- $suffix := .component }}
{{- $room := sub 62 (len $suffix) | int }}
{{- printf "%s-%s" (include "baton.fullname" .root | trunc $room | trimSuffix "-") $suffix }}
{{- end }}

{{- define "baton.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The selector: name, instance and component only, so that it never changes across upgrades. */}}
{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "baton.labels" -}}
{{ include "baton.selectorLabels" . }}
helm.sh/chart: {{ include "baton.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: {{ include "baton.name" .root }}
{{- end }}

{{/*
The pod template's labels: the object's without helm.sh/chart (a chart-only upgrade must not restart
every GPU pod and reload its model), plus the component's podLabels.
*/}}
{{- define "baton.podLabels" -}}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: {{ include "baton.name" .root }}
{{- /* The selector's keys stay the chart's: a podLabels entry may not change what selects the pod. */}}
{{- with omit (.podLabels | default dict) "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* "repository:tag" from a component's image override, falling back to .Values.image. */}}
{{- define "baton.image" -}}
{{- $img := .root.Values.image }}
{{- $over := .image | default dict }}
{{- $repo := $over.repository | default $img.repository }}
{{- $tag := $over.tag | default $img.tag | default .root.Chart.AppVersion }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{- define "baton.imagePullPolicy" -}}
{{- $over := .image | default dict }}
{{- $over.pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{- define "baton.serviceAccountName" -}}
{{- $sa := .root.Values.serviceAccount }}
{{- if and $sa.create $sa.perComponent }}
{{- include "baton.componentName" . }}
{{- else if $sa.create }}
{{- $sa.name | default (include "baton.fullname" .root) }}
{{- else }}
{{- $sa.name | default "default" }}
{{- end }}
{{- end }}

{{/* The pod spec fields every Baton pod shares. */}}
{{- define "baton.podCommon" -}}
serviceAccountName: {{ include "baton.serviceAccountName" . }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- /* A pool's own podSecurityContext keys replace the release-wide ones (set, not merge: merge
would keep a release-wide value over a pool's 0 or false). */}}
{{- $podSecurity := deepCopy (.root.Values.podSecurityContext | default dict) }}
{{- range $k, $v := (.values | default dict).podSecurityContext | default dict }}
{{- $_ := set $podSecurity $k $v }}
{{- end }}
{{- with $podSecurity }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Scheduling fields of a component's values. */}}
{{- define "baton.scheduling" -}}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "baton.schedulerAddress" -}}
{{- printf "%s:%d" (include "baton.componentName" (dict "root" . "component" "scheduler")) (int .Values.scheduler.port) }}
{{- end }}

{{- define "baton.modelDir" -}}
{{- $m := .Values.model }}
{{- if $m.subdir }}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimAll "/" $m.subdir) }}
{{- else }}
{{- $m.mountPath }}
{{- end }}
{{- end }}

{{- define "baton.modelClaimName" -}}
{{- .Values.model.volume.existingClaim | default (include "baton.componentName" (dict "root" . "component" "model")) }}
{{- end }}

{{/*
BATON_REDIS_URL for a container, always from a Secret: the chart's (bundled, random or given password),
or a URL composed from an existing password Secret (Kubernetes expands $(VAR) of an earlier variable), or
the external URL's Secret. The password never appears in a manifest.
*/}}
{{- define "baton.redisEnv" -}}
{{- $r := .Values.redis }}
{{- if eq $r.mode "external" }}
- name: BATON_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret }}
      key: {{ $r.external.urlKey }}
{{- else if $r.bundled.auth.existingSecret }}
- name: BATON_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $r.bundled.auth.existingSecret }}
      key: {{ $r.bundled.auth.existingSecretPasswordKey }}
- name: BATON_REDIS_URL
  value: {{ printf "redis://:$(BATON_REDIS_PASSWORD)@%s:%d/0" (include "baton.componentName" (dict "root" . "component" "redis")) (int $r.bundled.port) | quote }}
{{- else }}
- name: BATON_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "baton.componentName" (dict "root" . "component" "redis") }}
      key: redis-url
{{- end }}
{{- end }}

{{/* The Secret and key that hold the bundled Redis's password. */}}
{{- define "baton.redisPasswordRef" -}}
{{- $auth := .Values.redis.bundled.auth }}
{{- if $auth.existingSecret }}
name: {{ $auth.existingSecret }}
key: {{ $auth.existingSecretPasswordKey }}
{{- else }}
name: {{ include "baton.componentName" (dict "root" . "component" "redis") }}
key: redis-password
{{- end }}
{{- end }}

{{/* The model volume of a pod's spec.volumes. */}}
{{- define "baton.modelVolume" -}}
{{- $v := .Values.model.volume }}
- name: model
{{- if eq $v.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "baton.modelClaimName" . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $v.sizeLimit }}
{{- end }}
{{- end }}

{{/* Main containers only read the weights: a bug cannot damage a model that other pods share. */}}
{{- define "baton.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/* The init container that fetches the model into the volume before the main container reads it. */}}
{{- define "baton.fetchInitContainers" -}}
{{- $f := .root.Values.model.fetch }}
{{- if $f.enabled }}
initContainers:
  - name: fetch-model
    image: {{ include "baton.image" . | quote }}
    imagePullPolicy: {{ include "baton.imagePullPolicy" . }}
    command: [baton]
    args:
      - fetch-model
      - {{ $f.uri | quote }}
      - {{ include "baton.modelDir" .root | quote }}
      {{- range $f.extraArgs }}
      - {{ . | quote }}
      {{- end }}
    {{- with $f.hfTokenSecret.name }}
    env:
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ . }}
            key: {{ $f.hfTokenSecret.key }}
    {{- end }}
    {{- with $f.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .root.Values.containerSecurityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: model
        mountPath: {{ .root.Values.model.mountPath }}
{{- end }}
{{- end }}

{{/*
Probes of a Baton gRPC server (a grpc probe takes a port number, not a name). Startup and readiness ask the gRPC health service; liveness only opens
the port, because a draining process answers NOT_SERVING and restarting it would cut its drain short.
*/}}
{{- define "baton.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  tcpSocket:
    port: {{ .port }}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end }}

{{/* terminationGracePeriodSeconds: the preStop sleep, then the drain, then the time to exit. */}}
{{- define "baton.gracePeriod" -}}
{{- add (int .preStopSleepSeconds) (int .drainTimeoutSeconds) (int .terminationMarginSeconds) }}
{{- end }}

{{/* A preStop sleep: the kubelet's own sleep action where the cluster has it (1.30+), else `sleep`. */}}
{{- define "baton.preStop" -}}
{{- if gt (int .seconds) 0 }}
lifecycle:
  preStop:
    {{- if semverCompare ">=1.30.0-0" .root.Capabilities.KubeVersion.Version }}
    sleep:
      seconds: {{ int .seconds }}
    {{- else }}
    exec:
      command: ["sleep", "{{ int .seconds }}"]
    {{- end }}
{{- end }}
{{- end }}

{{/* The Prometheus peer of the metrics ports' ingress rules; no selector at all means anyone. */}}
{{- define "baton.prometheusPeer" -}}
{{- $p := .Values.networkPolicy.prometheus }}
{{- $peer := dict }}
{{- with $p.namespaceSelector }}{{ $_ := set $peer "namespaceSelector" . }}{{ end }}
{{- with $p.podSelector }}{{ $_ := set $peer "podSelector" . }}{{ end }}
{{- if not $peer }}{{ $_ := set $peer "namespaceSelector" dict }}{{ end }}
{{- toYaml (list $peer) }}
{{- end }}

{{/* The pools in a fixed order, each with its values, for templates that render one object per pool. */}}
{{- define "baton.enabledPools" -}}
{{- $pools := list }}
{{- range $name := list "prefill" "decode" }}
{{- if (index $.Values $name).enabled }}
{{- $pools = append $pools $name }}
{{- end }}
{{- end }}
{{- join "," $pools }}
{{- end }}

{{- define "baton.autoscalerEnabled" -}}
{{- if ne .Values.autoscaling.mode "none" }}true{{ end }}
{{- end }}

{{/* NetworkPolicy peers: one component's pods, and every worker pool's pods. */}}
{{- define "baton.peer" -}}
- podSelector:
    matchLabels:
      {{- include "baton.selectorLabels" . | nindent 6 }}
{{- end }}
{{- define "baton.workerPeers" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "baton.name" .root }}
      app.kubernetes.io/instance: {{ .root.Release.Name }}
    matchExpressions:
      - key: app.kubernetes.io/component
        operator: In
        values: [prefill, decode]
{{- end }}

{{/* --tls-dir (and --tls-server-name) of every Baton process, when security.tls.secretName is set. */}}
{{- define "baton.tlsArgs" -}}
{{- $t := .Values.security.tls }}
{{- if $t.secretName }}
- --tls-dir=/etc/baton/tls
{{- with $t.serverName }}
- --tls-server-name={{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The TLS Secret's mount (a container's volumeMounts item), when there is one. */}}
{{- define "baton.tlsMount" -}}
{{- if .Values.security.tls.secretName }}
- name: tls
  mountPath: /etc/baton/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The TLS Secret as a volume (spec.volumes item), when there is one. */}}
{{- define "baton.tlsVolume" -}}
{{- with .Values.security.tls.secretName }}
- name: tls
  secret:
    secretName: {{ . }}
    defaultMode: 0400
{{- end }}
{{- end }}

{{/*
Probes of a gRPC port: with mutual TLS the kubelet's gRPC probe cannot show a certificate, so startup
and readiness run `baton health` in the container (over mutual TLS with the pod's own certificate);
liveness only opens the port either way.
*/}}
{{- define "baton.probes" -}}
{{- if .root.Values.security.tls.secretName }}
{{- $cmd := list "baton" "health" (printf "127.0.0.1:%d" (int .port)) "--tls-dir=/etc/baton/tls" }}
{{- with .root.Values.security.tls.serverName }}{{ $cmd = append $cmd (printf "--tls-server-name=%s" .) }}{{ end }}
startupProbe:
  exec:
    command: {{ toJson $cmd }}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  exec:
    command: {{ toJson $cmd }}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  tcpSocket:
    port: {{ .port }}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- else }}
{{- include "baton.grpcProbes" . }}
{{- end }}
{{- end }}
