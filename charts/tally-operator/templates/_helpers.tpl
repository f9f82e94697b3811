{{- define "tally-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: also the name of its RBAC objects and of its kopf peering. */}}
{{- define "tally-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tally-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Immutable selector labels: never add to these after a release exists. */}}
{{- define "tally-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tally-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tally-operator.labels" -}}
{{ include "tally-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tally
helm.sh/chart: {{ include "tally-operator.chart" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The operator pods' pull secrets: imagePullSecrets and an umbrella chart's global.imagePullSecrets (names or
{name: ...}), each once. */}}
{{- define "tally-operator.imagePullSecrets" -}}
{{- $names := list -}}
{{- range concat (.Values.imagePullSecrets | default list) ((.Values.global | default dict).imagePullSecrets | default list) -}}
{{- $name := "" -}}
{{- if kindIs "string" . }}{{ $name = . }}{{ else if kindIs "map" . }}{{ $name = .name | default "" }}{{ end -}}
{{- if and $name (not (has $name $names)) }}{{ $names = append $names $name }}{{ end -}}
{{- end -}}
{{- range $names }}
- name: {{ . }}
{{- end -}}
{{- end -}}

{{- define "tally-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tally-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* What the operator may do to CompletionServices and their children, wherever it watches them. */}}
{{- define "tally-operator.namespacedRules" -}}
- apiGroups: [serving.tally.dev]
  resources: [completionservices]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.tally.dev]
  resources: [completionservices/status]
  verbs: [get, update, patch]  # update: the status is written whole, by compare-and-swap
# each service's per-tenant books, by tenant (replaced whole by compare-and-swap; gone with their service)
- apiGroups: [serving.tally.dev]
  resources: [usageshards]
  verbs: [get, list, create, update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]  # delete: a service's activator once it stops scaling to zero
# which pods a service owns: those of its Deployment's ReplicaSets
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]  # delete: its <name>-pods Service, likewise
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch]  # patch: the deletion cost that sends idle pods first on a scale-down
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
{{- end }}
{{- if .Values.inferencePool.enabled }}
# routing.inferencePool: the pool, and the endpoint picker the operator runs for it (bound only to the
# chart's picker ClusterRole: the operator writes no Role and can grant nothing else)
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [clusterroles]
  verbs: [bind]
  resourceNames: [{{ printf "%s-epp" (include "tally-operator.fullname" .) }}]
{{- end }}
{{- end -}}

{{/* The signing key's Secret. */}}
{{- define "tally-operator.signingSecret" -}}
{{- .Values.signingKey.existingSecret | default (printf "%s-signing" (include "tally-operator.fullname" .)) -}}
{{- end -}}

{{/* The signing key: the one the release's Secret holds, or a new one (the first install, or helm template). */}}
{{- define "tally-operator.signingKey" -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (printf "%s-signing" (include "tally-operator.fullname" .)) -}}
{{- if and $secret (index ($secret.data | default dict) "key.pem") -}}
{{- index $secret.data "key.pem" | b64dec -}}
{{- else -}}
{{- if not (hasKey .Values "_signingKey") -}}
{{- $_ := set .Values "_signingKey" (genPrivateKey "ed25519") -}}
{{- end -}}
{{- .Values._signingKey -}}
{{- end -}}
{{- end -}}

{{/* An umbrella chart's global.imageRegistry ("" when none). */}}
{{- define "tally-operator.globalRegistry" -}}
{{- trimSuffix "/" ((.Values.global | default dict).imageRegistry | default "") -}}
{{- end -}}

{{/* The operator image: [registry/]repository:tag[@digest]; image.registry, else global.imageRegistry. */}}
{{- define "tally-operator.image" -}}
{{- $i := .Values.image -}}
{{- $registry := $i.registry | default (include "tally-operator.globalRegistry" .) -}}
{{- $repo := ternary (printf "%s/%s" (trimSuffix "/" $registry) $i.repository) $i.repository (ne $registry "") -}}
{{- $ref := printf "%s:%s" $repo ($i.tag | default .Chart.AppVersion) -}}
{{- if $i.digest }}{{ printf "%s@%s" $ref $i.digest }}{{ else }}{{ $ref }}{{ end -}}
{{- end -}}

{{/* The runtime image: runtimeImage, with global.imageRegistry put before it when it names no registry of its own
(its first path part has no dot, colon or "localhost"), as a Docker reference reads it. */}}
{{- define "tally-operator.runtimeImage" -}}
{{- $image := .Values.runtimeImage -}}
{{- $registry := include "tally-operator.globalRegistry" . -}}
{{- $first := splitList "/" $image | first -}}
{{- $hasRegistry := and (gt (len (splitList "/" $image)) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) -}}
{{- if and $registry (not $hasRegistry) }}{{ printf "%s/%s" $registry $image }}{{ else }}{{ $image }}{{ end -}}
{{- end -}}
