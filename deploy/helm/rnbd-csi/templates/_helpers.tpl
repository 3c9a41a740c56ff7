{{/*
The names and labels of the chart's objects. The labels carry no
helm.sh/chart or managed-by: Helm, because the same rendering is the
plain manifests of deploy/kubernetes, applied with kubectl. The
selectors are app.kubernetes.io/name and component only, as they were
before the chart: a selector cannot change on an existing object.
*/}}

{{- define "rnbd-csi.name" -}}
{{- .Chart.Name -}}
{{- end }}

{{/* The prefix of every object's name: the release's name, "rnbd-csi" where it holds the chart's. */}}
{{- define "rnbd-csi.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end }}

{{- define "rnbd-csi.labels" -}}
app.kubernetes.io/name: {{ include "rnbd-csi.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The selector of the pods of a component: (dict "ctx" $ "component" "controller"). */}}
{{- define "rnbd-csi.selector" -}}
app.kubernetes.io/name: {{ include "rnbd-csi.name" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "rnbd-csi.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end }}

{{/* A TOML array of strings: ["a", "b"]. JSON's string escapes are TOML's. */}}
{{- define "rnbd-csi.tomlStrings" -}}
[{{ range $i, $s := . }}{{ if $i }}, {{ end }}{{ $s | toString | toJson }}{{ end }}]
{{- end }}

{{/* A TOML inline table of strings: { "k" = "v" }, keys sorted. */}}
{{- define "rnbd-csi.tomlTable" -}}
{{- $t := . -}}
{ {{- range $i, $k := keys $t | sortAlpha }}{{ if $i }},{{ end }} {{ $k | toJson }} = {{ index $t $k | toString | toJson }}{{ end }} }
{{- end }}

{{/* The directory of the node plugin's socket on the host. */}}
{{- define "rnbd-csi.pluginDir" -}}
{{- printf "%s/plugins/%s" (clean .Values.kubeletDir) .Values.driverName -}}
{{- end }}

{{/* The securityContext of a sidecar: no privilege, nothing written but its volumes. */}}
{{- define "rnbd-csi.sidecarSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Checks of the values that the schema cannot say, failing the rendering with what to give. */}}
{{- define "rnbd-csi.validate" -}}
{{- if not (isAbs .Values.kubeletDir) -}}
{{- fail (printf "kubeletDir %q: want the kubelet's root directory, an absolute path (/var/lib/kubelet)" .Values.kubeletDir) -}}
{{- end -}}
{{- if not (isAbs .Values.config.clientSocket) -}}
{{- fail (printf "config.clientSocket %q: want an absolute path (/run/rnbd/client.sock)" .Values.config.clientSocket) -}}
{{- end -}}
{{- if eq (dir .Values.config.clientSocket) "/" -}}
{{- fail (printf "config.clientSocket %q: want it in a directory of its own (/run/rnbd/client.sock): the node plugin mounts that directory from the host" .Values.config.clientSocket) -}}
{{- end -}}
{{- if not .Values.storageNodes -}}
{{- fail "storageNodes: give at least one storage node (name, admin, paths, pool): the controller places volumes on them" -}}
{{- end -}}
{{- $c := .Values.certificates -}}
{{- if and (or $c.cert $c.key $c.ca) (not (and $c.cert $c.key $c.ca)) -}}
{{- fail "certificates: give cert, key and ca together (the chart makes the Secret), or none of them (the Secret certificates.secretName must exist)" -}}
{{- end -}}
{{- $ports := dict -}}
{{- range $name, $port := .Values.ports -}}
{{- if hasKey $ports (toString $port) -}}
{{- fail (printf "ports: %s and %s are both %v: the containers of a pod share its ports" (get $ports (toString $port)) $name $port) -}}
{{- end -}}
{{- $_ := set $ports (toString $port) $name -}}
{{- end -}}
{{- end }}

{{/* The liveness probe of a controller sidecar on its --http-endpoint port (the argument's port), within probes' bounds or a leader's own (10 s, every 20 s): restarted when, as the leader, it stopped renewing its lease. */}}
{{- define "rnbd-csi.leaderProbe" -}}
livenessProbe:
  httpGet:
    path: /healthz/leader-election
    port: {{ .port }}
  initialDelaySeconds: 10
  periodSeconds: {{ max 20 .probes.periodSeconds }}
  timeoutSeconds: {{ max 10 .probes.timeoutSeconds }}
  failureThreshold: 3
{{- end }}

{{/* The sidecars' leader election timings that controller.leaderElection sets (none: the sidecars' own), as arguments. */}}
{{- define "rnbd-csi.leaderElectionArgs" -}}
{{- $a := list -}}
{{- with .leaseDuration }}{{ $a = append $a (printf "- --leader-election-lease-duration=%s" .) }}{{ end -}}
{{- with .renewDeadline }}{{ $a = append $a (printf "- --leader-election-renew-deadline=%s" .) }}{{ end -}}
{{- with .retryPeriod }}{{ $a = append $a (printf "- --leader-election-retry-period=%s" .) }}{{ end -}}
{{- join "\n" $a -}}
{{- end }}
