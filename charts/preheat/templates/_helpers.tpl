{{/* Names and labels shared by every object. */}}
{{- define "preheat.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "preheat.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "preheat.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "preheat.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Where workers find the staged snapshot. */}}
{{- define "preheat.snapshotDir" -}}
{{- printf "%s/snapshots" .Values.warmpool.hostPath -}}
{{- end -}}

{{/* "true" when the warm-pool agents keep parked standbys. */}}
{{- define "preheat.standbys" -}}
{{- if and .Values.warmpool.enabled (or (gt (int .Values.warmpool.standbys.prefill) 0) (gt (int .Values.warmpool.standbys.decode) 0)) -}}
true
{{- end -}}
{{- end -}}

{{/* The Secret holding the cluster token (key `token`). */}}
{{- define "preheat.tokenSecret" -}}
{{- default (printf "%s-cluster-token" (include "preheat.fullname" .)) .Values.clusterToken.existingSecret -}}
{{- end -}}

{{/* Every pod's view of the cluster token: env, mount, volume. */}}
{{- define "preheat.tokenEnv" -}}
- name: PREHEAT_CLUSTER_TOKEN_FILE
  value: /var/run/preheat/cluster-token/token
{{- end -}}
{{- define "preheat.tokenMount" -}}
- {name: cluster-token, mountPath: /var/run/preheat/cluster-token, readOnly: true}
{{- end -}}
{{- define "preheat.tokenVolume" -}}
- name: cluster-token
  secret: {secretName: {{ include "preheat.tokenSecret" . }}, defaultMode: 0444}
{{- end -}}

{{- /* Peers by component, in this release. */}}
{{- define "preheat.peer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/instance: {{ .root.Release.Name }}
      app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The model source from a Secret, as $PREHEAT_MODEL_SOURCE (read by the
     gateway's --model and the staging step's --source, never in argv). */}}
{{- define "preheat.modelSourceEnv" -}}
{{- if .Values.model.sourceSecret.name }}
- name: PREHEAT_MODEL_SOURCE
  valueFrom:
    secretKeyRef: {name: {{ .Values.model.sourceSecret.name }}, key: {{ .Values.model.sourceSecret.key }}}
{{- end }}
{{- end -}}
{{/* "true" when the source is a file on the nodes (mounted into the gateway). */}}
{{- define "preheat.localSource" -}}
{{- if and (not .Values.model.sourceSecret.name) (not (regexMatch "^https?://" .Values.model.source)) -}}
true
{{- end -}}
{{- end -}}

{{/* The one root step: gives the node's hostPath tree (root-owned when the kubelet
     makes it) to the user everything else runs as, with CAP_CHOWN alone. */}}
{{- define "preheat.ownInit" -}}
- name: own
  image: {{ include "preheat.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args: [warmpool, own, --uid=65532, --gid=65532, {{ .dir | quote }}]
  volumeMounts:
    - {name: {{ .volume }}, mountPath: {{ .dir }}}
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL], add: [CHOWN]}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
{{- end -}}
