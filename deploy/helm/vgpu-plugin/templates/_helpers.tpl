{{/* The chart's name, or nameOverride. */}}
{{- define "vgpu-plugin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name: fullnameOverride, else the release name (with the chart's name when
the release name does not already contain it). */}}
{{- define "vgpu-plugin.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "vgpu-plugin.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "vgpu-plugin.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "vgpu-plugin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vgpu-plugin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vgpu-plugin.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "vgpu-plugin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "vgpu-plugin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vgpu-plugin.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "vgpu-plugin.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Where the plugin reads its node's labels (key=value lines); empty: nowhere. */}}
{{- define "vgpu-plugin.nodeLabelsFile" -}}
{{- if .Values.nodeLabels.fromAPI }}
{{- "/run/vgpu-node-labels/labels" }}
{{- else if .Values.nodeLabels.hostFile }}
{{- printf "/run/vgpu-host-labels/%s" (base .Values.nodeLabels.hostFile) }}
{{- end }}
{{- end }}

{{/* The restricted security context of every container: no privilege, no capability, a
read-only root. The plugin runs as root only to use the kubelet's root-owned sockets and to
write the host root; hostPath mounts are its only way out of the container. */}}
{{- define "vgpu-plugin.restrictedSecurityContext" -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsUser: 0
runAsNonRoot: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* What every container runs with: the restricted context above, with the chart's
securityContext value merged over it (its keys win; e.g. seLinuxOptions, appArmorProfile). */}}
{{- define "vgpu-plugin.securityContext" -}}
{{- if .Values.securityContext }}
{{- $restricted := include "vgpu-plugin.restrictedSecurityContext" . | fromYaml }}
{{- toYaml (mustMergeOverwrite $restricted (deepCopy .Values.securityContext)) }}
{{- else }}
{{- include "vgpu-plugin.restrictedSecurityContext" . }}
{{- end }}
{{- end }}
