{{/* Names: at most 40 characters, so that "<fullname>-ratelimitd-headless" stays within 63. */}}
{{- define "apportion.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "apportion.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: apportion
apportion.io/region: {{ .Values.region }}
{{- end -}}

{{- define "apportion.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The backend and log settings both binaries take, as APPORTION_* variables. */}}
{{- define "apportion.commonEnv" -}}
- name: APPORTION_REGION
  value: {{ .Values.region | quote }}
- name: APPORTION_REDIS_ADDR
  value: {{ .Values.redis.addr | quote }}
{{- if .Values.redis.tls }}
- name: APPORTION_REDIS_TLS
  value: "true"
{{- end }}
- name: APPORTION_NATS_URL
  value: {{ .Values.nats.url | quote }}
- name: APPORTION_ETCD_ENDPOINTS
  value: {{ .Values.etcd.endpoints | quote }}
- name: APPORTION_ETCD_PREFIX
  value: {{ .Values.etcd.prefix | quote }}
- name: APPORTION_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secretName }}
      key: redis-password
      optional: true
- name: APPORTION_ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secretName }}
      key: etcd-password
      optional: true
- name: APPORTION_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
- name: APPORTION_LOG_LEVEL
  value: {{ .Values.log.level | quote }}
{{- end -}}
