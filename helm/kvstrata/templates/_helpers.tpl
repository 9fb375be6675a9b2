{{/* Names: every object is <fullname> or <fullname>-<part>, at most 63 characters. */}}
{{- define "kvstrata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvstrata.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvstrata.labels" -}}
{{ include "kvstrata.selectorLabels" . }}
{{ include "kvstrata.metaLabels" . }}
{{- end -}}

{{/* The labels that select nothing; pod templates add them to their selector labels. */}}
{{- define "kvstrata.metaLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvstrata
{{- end -}}

{{/* The labels every pod of the release carries; the default-deny NetworkPolicy selects them. */}}
{{- define "kvstrata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstrata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Ray pods: the head and every worker pod. */}}
{{- define "kvstrata.rayLabels" -}}
{{ include "kvstrata.selectorLabels" . }}
kvstrata.io/ray-node: "true"
{{- end -}}

{{- define "kvstrata.headLabels" -}}
{{ include "kvstrata.rayLabels" . }}
app.kubernetes.io/component: head
{{- end -}}

{{- define "kvstrata.workerLabels" -}}
{{ include "kvstrata.rayLabels" . }}
app.kubernetes.io/component: worker
{{- end -}}

{{- define "kvstrata.redisLabels" -}}
{{ include "kvstrata.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "kvstrata.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvstrata.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvstrata.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "kvstrata.redisImage" -}}
{{- $i := .Values.redis.bundled.image -}}
{{- if $i.digest -}}
{{- printf "%s@%s" $i.repository $i.digest -}}
{{- else -}}
{{- printf "%s:%s" $i.repository $i.tag -}}
{{- end -}}
{{- end -}}

{{/* Secret names: the user's existing Secret, or the one this chart makes. */}}
{{- define "kvstrata.rayTokenSecret" -}}
{{- default (printf "%s-ray-token" (include "kvstrata.fullname" .)) .Values.ray.auth.existingSecret -}}
{{- end -}}
{{- define "kvstrata.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "kvstrata.fullname" .)) .Values.frontend.apiKeys.existingSecret -}}
{{- end -}}
{{- define "kvstrata.cacheSaltSecret" -}}
{{- default (printf "%s-cache-salt" (include "kvstrata.fullname" .)) .Values.frontend.cacheSalt.existingSecret -}}
{{- end -}}
{{- define "kvstrata.redisPasswordSecret" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- default (printf "%s-redis" (include "kvstrata.fullname" .)) .Values.redis.bundled.auth.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}
{{- define "kvstrata.redisPasswordKey" -}}
{{- if eq .Values.redis.mode "bundled" -}}{{ .Values.redis.bundled.auth.key }}{{- else -}}{{ .Values.redis.external.key }}{{- end -}}
{{- end -}}

{{/*
A Secret's value that survives upgrades: the live Secret's data when it exists (lookup), else a new
random one. `helm template` has no cluster, so it always draws a new value.
Call with (dict "ctx" $ "name" NAME "key" KEY "value" PLAINTEXT-IF-NEW).
*/}}
{{- define "kvstrata.keptSecretData" -}}
{{- $live := lookup "v1" "Secret" .ctx.Release.Namespace .name -}}
{{- if and $live $live.data (hasKey $live.data .key) -}}
{{- index $live.data .key -}}
{{- else -}}
{{- .value | b64enc -}}
{{- end -}}
{{- end -}}

{{- define "kvstrata.redisUrl" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "kvstrata.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "kvstrata.numWorkers" -}}
{{- $n := 0 -}}
{{- range .Values.pools -}}{{- $n = add $n .replicas -}}{{- end -}}
{{- $n -}}
{{- end -}}

{{/* The restricted security context of every container. */}}
{{- define "kvstrata.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: {{ .Values.podSecurity.readOnlyRootFilesystem }}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvstrata.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Env of every container that talks to Ray: token auth from a mounted file, writable home. */}}
{{- define "kvstrata.rayEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN_PATH
  value: /var/run/kvstrata/ray-token/{{ .Values.ray.auth.key }}
- name: HOME
  value: /tmp
- name: KVSTRATA_CACHE_DIR
  value: /var/cache/kvstrata
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- end -}}

{{- define "kvstrata.rayTokenVolume" -}}
- name: ray-token
  secret:
    secretName: {{ include "kvstrata.rayTokenSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.ray.auth.key }}
        path: {{ .Values.ray.auth.key }}
{{- end -}}

{{/* Volumes every Ray container mounts; the pod adds /dev/shm with its own size. */}}
{{- define "kvstrata.rayCommonVolumes" -}}
{{ include "kvstrata.rayTokenVolume" . }}
- name: tmp
  emptyDir: {}
- name: kvstrata-cache
  emptyDir: {}
{{- if ne .Values.model.volume.type "none" }}
- name: models
  {{- if eq .Values.model.volume.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.claimName }}
    readOnly: true
  {{- else }}
  hostPath:
    path: {{ .Values.model.volume.hostPath }}
    type: Directory
  {{- end }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tlsCaSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.external.tlsCaSecret }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}

{{- define "kvstrata.rayCommonMounts" -}}
- name: ray-token
  mountPath: /var/run/kvstrata/ray-token
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
- name: kvstrata-cache
  mountPath: /var/cache/kvstrata
{{- if ne .Values.model.volume.type "none" }}
- name: models
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: true
{{- end }}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tlsCaSecret }}
- name: redis-ca
  mountPath: /etc/kvstrata/redis-ca
  readOnly: true
{{- end }}
{{- end -}}

{{/* checkov.io/skip annotations for objects of one kind, from .Values.checkovSkips. */}}
{{- define "kvstrata.checkovSkips" -}}
{{- $skips := index .ctx.Values.checkovSkips .kind | default list -}}
{{- range $i, $s := $skips }}
checkov.io/skip{{ add1 $i }}: {{ printf "%s=%s" $s.id ($s.reason | trim) | quote }}
{{- end -}}
{{- end -}}
