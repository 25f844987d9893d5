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

{{/* The served models as one list (JSON; read with `include ... | fromJsonArray`),
     whichever form the values use. Each entry:
       name, source, secretName, secretKey
       env:       the variable the gateway and the agent read a Secret's source from
       infix:     "" (one-model form: today's object names) or "-<name>"
       listed:    from `models:` (its pods' selectors carry the model label)
       priority
       prefill, decode: the pool's values, the model's keys over the top-level ones
       standbys:  {prefill: N, decode: N}
       sbFirst:   {prefill: k, decode: k}: the index of its first standby port of
                  each pool among every model's (they follow one another) */}}
{{- define "preheat.models" -}}
{{- $v := .Values -}}
{{- $entries := list -}}
{{- if $v.models -}}
{{- $entries = $v.models -}}
{{- else -}}
{{- $m := $v.model -}}
{{- $name := $m.name -}}
{{- if not $name -}}
{{- if $m.sourceSecret.name -}}
{{- fail "model.name is required with model.sourceSecret (the source, and its file name, are in the Secret)" -}}
{{- end -}}
{{- $base := base (regexReplaceAll "[?#].*$" $m.source "") -}}
{{- $stem := regexReplaceAll "\\.[^.]*$" $base "" -}}
{{- $name = regexReplaceAll "[^a-z0-9]+" (lower $stem) "-" | trimAll "-" | trunc 63 | trimSuffix "-" -}}
{{- if not $name -}}
{{- fail (printf "model.source %q has no file name to name the model by: set model.name" $m.source) -}}
{{- end -}}
{{- end -}}
{{- $entries = list (dict "name" $name "source" $m.source "sourceSecret" $m.sourceSecret) -}}
{{- end -}}
{{- $fn := include "preheat.fullname" . -}}
{{- $seen := dict -}}
{{- $next := dict "prefill" 0 "decode" 0 -}}
{{- $out := list -}}
{{- range $i, $e := $entries -}}
{{- if hasKey $seen $e.name -}}
{{- fail (printf "models: %q appears twice (names are what clients ask for, and name each model's objects)" $e.name) -}}
{{- end -}}
{{- $_ := set $seen $e.name true -}}
{{- $listed := not (empty $v.models) -}}
{{- $infix := ternary (printf "-%s" $e.name) "" $listed -}}
{{- $longest := printf "%s%s-prefill" $fn $infix -}}
{{- if gt (len $longest) 63 -}}
{{- fail (printf "models: %q makes the Service name %s, longer than 63 characters: shorten the model or release name" $e.name $longest) -}}
{{- end -}}
{{- $secret := $e.sourceSecret | default dict -}}
{{- $entry := dict "name" $e.name "source" ($e.source | default "") "secretName" ($secret.name | default "") "secretKey" ($secret.key | default "source") -}}
{{- $_ := set $entry "env" (ternary (printf "PREHEAT_MODEL_SOURCE_%d" $i) "PREHEAT_MODEL_SOURCE" $listed) -}}
{{- $_ := set $entry "infix" $infix -}}
{{- $_ := set $entry "listed" $listed -}}
{{- $_ := set $entry "priority" ($e.priority | default 0) -}}
{{- $sbGiven := $e.standbys | default dict -}}
{{- $sb := dict -}}
{{- $first := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $p := deepCopy (index $v $role) -}}
{{- if not (hasKey $p "idleGraceSeconds") -}}
{{- $_ := set $p "idleGraceSeconds" $v.scaler.idleGraceSeconds -}}
{{- end -}}
{{- range $k, $val := (index $e $role | default dict) -}}
{{- $_ := set $p $k $val -}}
{{- end -}}
{{- $_ := set $entry $role $p -}}
{{- $n := int (ternary (index $sbGiven $role) (index $v.warmpool.standbys $role) (hasKey $sbGiven $role)) -}}
{{- $_ := set $sb $role $n -}}
{{- $_ := set $first $role (index $next $role) -}}
{{- $_ := set $next $role (add (index $next $role) $n) -}}
{{- end -}}
{{- $_ := set $entry "standbys" $sb -}}
{{- $_ := set $entry "sbFirst" $first -}}
{{- $out = append $out $entry -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* A model's pool pods: the component, and in the list form the model. */}}
{{- define "preheat.poolSelector" -}}
{{- include "preheat.selector" (dict "root" .root "component" .role) }}
{{- if .m.listed }}
preheat.dev/model: {{ .m.name | quote }}
{{- end }}
{{- end -}}

{{/* The same as a label-selector string (the scaler's `selector`). */}}
{{- define "preheat.poolSelectorString" -}}
{{- printf "app.kubernetes.io/instance=%s,app.kubernetes.io/component=%s" .root.Release.Name .role -}}
{{- if .m.listed }},preheat.dev/model={{ .m.name }}{{ end -}}
{{- end -}}

{{/* The agents' name of a model's standby pool: the role alone in the one-model
     form, `<model>-<role>` in the list form (what the gateway looks for). */}}
{{- define "preheat.standbyPool" -}}
{{- if .m.listed }}{{ .m.name }}-{{ end }}{{ .role -}}
{{- end -}}

{{/* The port of standby `j` of a model's pool (its KV port is the next one). */}}
{{- define "preheat.standbyPort" -}}
{{- $i := ternary 0 1 (eq .role "prefill") -}}
{{- add .root.Values.warmpool.standbys.basePort (mul $i 1000) (mul (add (index .m.sbFirst .role) .j) 2) -}}
{{- end -}}

{{/* The container port name of that standby (the PodMonitor scrapes it by name). */}}
{{- define "preheat.standbyPortName" -}}
{{- printf "sb-%s-%d" (substr 0 1 .role) (add (index .m.sbFirst .role) .j) -}}
{{- end -}}

{{/* "true" when any model has parked standbys. */}}
{{- define "preheat.anyStandbys" -}}
{{- if .Values.warmpool.enabled -}}
{{- range (include "preheat.models" . | fromJsonArray) -}}
{{- if or (gt (int .standbys.prefill) 0) (gt (int .standbys.decode) 0) }}true{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A memory quantity ("32Gi", "512Mi", "64GiB", "1G", bytes) in MiB, rounded up:
     what the agent pod's resources add up. */}}
{{- define "preheat.mib" -}}
{{- $q := toString . -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- $unit := trimPrefix $num $q -}}
{{- $per := dict "" 0.00000095367431640625 "Ki" 0.0009765625 "KiB" 0.0009765625 "Mi" 1.0 "MiB" 1.0 "Gi" 1024.0 "GiB" 1024.0 "Ti" 1048576.0 "TiB" 1048576.0 "K" 0.0009536743 "KB" 0.0009536743 "M" 0.95367431640625 "MB" 0.95367431640625 "G" 953.67431640625 "GB" 953.67431640625 "T" 953674.31640625 "TB" 953674.31640625 -}}
{{- if or (not $num) (not (hasKey $per $unit)) -}}
{{- fail (printf "%q is not a memory quantity the chart can add up (a number with Ki, Mi, Gi, Ti, K, M, G or T)" $q) -}}
{{- end -}}
{{- mulf (float64 $num) (index $per $unit) | ceil | int -}}
{{- end -}}

{{/* The agent pod's resources: `warmpool.resources`, plus what its standbys hold
     (each a worker of its pool: the pool's memory and GPUs, for `count` parked and
     up to `count` promoted of each pool), plus the hot set where it is pinned (mlock:
     locked pages are charged and never reclaimed). */}}
{{- define "preheat.agentResources" -}}
{{- $res := deepCopy .Values.warmpool.resources -}}
{{- $req := dict "mem" 0 "gpu" 0 -}}
{{- $lim := dict "mem" 0 -}}
{{- if include "preheat.anyStandbys" . -}}
{{- range $m := include "preheat.models" . | fromJsonArray -}}
{{- range $role := list "prefill" "decode" -}}
{{- $n := int (index $m.standbys $role) -}}
{{- if gt $n 0 -}}
{{- $r := (index $m $role).resources -}}
{{- $rq := $r.requests | default dict -}}
{{- $rl := $r.limits | default dict -}}
{{- $each := int (include "preheat.mib" (index $rq "memory" | default (index $rl "memory") | default "0")) -}}
{{- $eachLim := int (include "preheat.mib" (index $rl "memory" | default (index $rq "memory") | default "0")) -}}
{{- $gpus := int (index $rl "nvidia.com/gpu" | default (index $rq "nvidia.com/gpu") | default 0) -}}
{{- $_ := set $req "mem" (add (index $req "mem") (mul 2 $n $each)) -}}
{{- $_ := set $lim "mem" (add (index $lim "mem") (mul 2 $n $eachLim)) -}}
{{- $_ := set $req "gpu" (add (index $req "gpu") (mul 2 $n $gpus)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.warmpool.mlock -}}
{{- $hot := int (include "preheat.mib" .Values.warmpool.memoryBudget) -}}
{{- $_ := set $req "mem" (add (index $req "mem") $hot) -}}
{{- $_ := set $lim "mem" (add (index $lim "mem") $hot) -}}
{{- end -}}
{{- $requests := $res.requests | default dict -}}
{{- $limits := $res.limits | default dict -}}
{{- if gt (int (index $req "mem")) 0 -}}
{{- $_ := set $requests "memory" (printf "%dMi" (add (int (include "preheat.mib" (index $requests "memory" | default "0"))) (index $req "mem"))) -}}
{{- end -}}
{{- if and (gt (int (index $lim "mem")) 0) (index $limits "memory") -}}
{{- $_ := set $limits "memory" (printf "%dMi" (add (int (include "preheat.mib" (index $limits "memory"))) (index $lim "mem"))) -}}
{{- end -}}
{{- if gt (int (index $req "gpu")) 0 -}}
{{- $_ := set $requests "nvidia.com/gpu" (index $req "gpu") -}}
{{- $_ := set $limits "nvidia.com/gpu" (index $req "gpu") -}}
{{- end -}}
{{- $_ := set $res "requests" $requests -}}
{{- $_ := set $res "limits" $limits -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Whether the scaler marks pool pods with their deletion cost: asked for, and the
     pools' pods are watched (not read from Prometheus). "true" or "false". */}}
{{- define "preheat.podDeletionCost" -}}
{{- and .Values.scaler.podDeletionCost (not .Values.scaler.prometheus.url) | toString -}}
{{- end }}
