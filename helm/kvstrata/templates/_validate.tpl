{{/*
Checks that values.schema.json cannot express: they span several fields. Each failure names the
fields and says what to change.
*/}}
{{- define "kvstrata.validate" -}}
{{- $names := dict -}}
{{- range $i, $p := .Values.pools -}}
{{- if hasKey $names $p.name -}}
{{- fail (printf "pools[%d].name: %q is used by another pool; pool names must be unique" $i $p.name) -}}
{{- end -}}
{{- $_ := set $names $p.name true -}}
{{- with $p.rayStartParams -}}
{{- if and (hasKey . "num-gpus") (ne (toString (index . "num-gpus")) (toString $.Values.tp)) -}}
{{- fail (printf "pools[%d].rayStartParams.num-gpus: must be tp (%d) or left out; every worker pod holds one worker group of tp GPUs" $i (int $.Values.tp)) -}}
{{- end -}}
{{- end -}}
{{- range $kind := list "requests" "limits" -}}
{{- if and $p.resources (hasKey (default dict (index $p.resources $kind)) $.Values.gpuResourceName) -}}
{{- fail (printf "pools[%d].resources.%s: leave out %s; the chart sets it to tp (%d)" $i $kind $.Values.gpuResourceName (int $.Values.tp)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if lt (int (include "kvstrata.numWorkers" .)) 1 -}}
{{- fail "pools: the replicas of all pools add up to 0; kvstrata needs at least one worker pod" -}}
{{- end -}}
{{- if and .Values.kvCache.nvme.enabled (not .Values.kvCache.dramBytes) -}}
{{- fail "kvCache.nvme.enabled needs kvCache.dramBytes: blocks reach the NVMe tier by demotion from DRAM" -}}
{{- end -}}
{{- if and .Values.frontend.disableGrpc .Values.frontend.disableHttp -}}
{{- fail "frontend.disableGrpc and frontend.disableHttp: at least one front end must be on" -}}
{{- end -}}
{{- if and .Values.frontend.tls.clientCaSecret (not .Values.frontend.tls.existingSecret) -}}
{{- fail "frontend.tls.clientCaSecret (mTLS) needs frontend.tls.existingSecret (the server certificate)" -}}
{{- end -}}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.url) -}}
{{- fail "redis.external.url is required when redis.mode is external" -}}
{{- end -}}
{{- if and .Values.redis.external.tlsCaSecret (eq .Values.redis.mode "external") (not (hasPrefix "rediss://" .Values.redis.external.url)) -}}
{{- fail "redis.external.tlsCaSecret is set but redis.external.url is not rediss://" -}}
{{- end -}}
{{- if and (eq .Values.model.volume.type "persistentVolumeClaim") (not .Values.model.volume.claimName) -}}
{{- fail "model.volume.claimName is required when model.volume.type is persistentVolumeClaim" -}}
{{- end -}}
{{- if and (eq .Values.model.volume.type "hostPath") (not .Values.model.volume.hostPath) -}}
{{- fail "model.volume.hostPath is required when model.volume.type is hostPath" -}}
{{- end -}}
{{- if and (eq .Values.kvCache.nvme.volume.type "ephemeral") .Values.kvCache.nvme.enabled (not .Values.kvCache.nvme.volume.storageClassName) -}}
{{- fail "kvCache.nvme.volume.storageClassName is required when kvCache.nvme.volume.type is ephemeral" -}}
{{- end -}}
{{- end -}}
