{{/*
Names, labels and the pieces of pod spec that the master and the store nodes share. Helpers that
take a component are called with (dict "ctx" $ "component" "master"|"store-node").
*/}}

{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RELEASE-kvpool, cut so that "-store-node" and a StatefulSet's pod suffix still fit 63. */}}
{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of a component's objects: RELEASE-kvpool-master, RELEASE-kvpool-store-node. */}}
{{- define "kvpool.componentName" -}}
{{- printf "%s-%s" (include "kvpool.fullname" .ctx) .component }}
{{- end }}

{{/* Kubernetes' recommended labels (app.kubernetes.io/*). */}}
{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvpool
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* What a component's workload, Service, PDB and NetworkPolicy select its pods by. */}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "true" when the masters elect a leader on etcd (standby masters), else empty. */}}
{{- define "kvpool.ha" -}}
{{- if .Values.etcd.endpoints }}true{{ end }}
{{- end }}

{{/*
etcd://HOST:PORT[,HOST:PORT]/CLUSTER: the masters' --ha, the nodes' and clients' --master. The
default election is named after the release (kvpool takes letters, digits, - and _ there; a
release name may hold dots).
*/}}
{{- define "kvpool.etcdUrl" -}}
{{- $cluster := default (include "kvpool.fullname" . | replace "." "-") .Values.etcd.cluster }}
{{- printf "etcd://%s/%s" (join "," .Values.etcd.endpoints) $cluster }}
{{- end }}

{{/* Where store nodes and clients find the master: the etcd election, or the master's Service. */}}
{{- define "kvpool.masterAddress" -}}
{{- if include "kvpool.ha" . }}
{{- include "kvpool.etcdUrl" . }}
{{- else }}
{{- printf "%s.%s.svc:%v" (include "kvpool.componentName" (dict "ctx" . "component" "master")) .Release.Namespace .Values.master.ports.grpc }}
{{- end }}
{{- end }}

{{- define "kvpool.logArgs" -}}
- --log-level={{ .Values.logLevel }}
- --log-format={{ .Values.logFormat }}
{{- end }}

{{/* The pod's own addresses, for $(POD_IP) and friends in the arguments. */}}
{{- define "kvpool.downwardEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}

{{/*
Liveness on /healthz (200 while the process runs), readiness on the given path, and a startup
probe that gives a starting process (a node populating its segments, reserving its disk tier) a
few minutes before liveness counts. Called with (dict "port" NAME "readiness" PATH).
*/}}
{{- define "kvpool.probes" -}}
startupProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: 2
  failureThreshold: 150
livenessProbe:
  httpGet:
    path: /healthz
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: {{ .readiness }}
    port: {{ .port }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
{{- end }}

{{- define "kvpool.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Called with (dict "ctx" $ "ipcLock" BOOL): IPC_LOCK lets RDMA pin the segments. */}}
{{- define "kvpool.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
  {{- if .ipcLock }}
  add: [IPC_LOCK]
  {{- end }}
{{- end }}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
What both pod specs start with. Called with (dict "ctx" $ "component" NAME "values" VALUES),
VALUES being .Values.master or .Values.storeNode.
*/}}
{{- define "kvpool.podSpecCommon" -}}
{{- $ctx := .ctx -}}
serviceAccountName: {{ include "kvpool.serviceAccountName" $ctx }}
automountServiceAccountToken: false
# kvpool reads KVPOOL_MASTER and KVPOOL_<setting> variables: keep the namespace's Service
# variables (KVPOOL_MASTER_PORT=tcp://... for a release named kvpool) out of its environment.
enableServiceLinks: false
securityContext:
  {{- include "kvpool.podSecurityContext" $ctx | nindent 2 }}
terminationGracePeriodSeconds: {{ .values.terminationGracePeriodSeconds }}
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
affinity:
  {{- if .values.affinity }}
  {{- toYaml .values.affinity | nindent 2 }}
  {{- else }}
  # Two of a component on one host would fail together.
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "kvpool.selectorLabels" . | nindent 14 }}
  {{- end }}
{{- end }}

{{/* Pod template metadata. Called like kvpool.podSpecCommon, plus "annotations" (a dict). */}}
{{- define "kvpool.podMetadata" -}}
labels:
  {{- include "kvpool.labels" . | nindent 2 }}
  {{- with .values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- $annotations := merge (dict) (.annotations | default dict) .values.podAnnotations }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Python and the libraries may want a scratch directory; the root filesystem is read-only. */}}
{{- define "kvpool.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{- define "kvpool.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
Credentials (values security.*). Each kvpool container reads its own credentials file from its
component's Secret, mounted here; "kvpool.credentialsPrefix" names the Secrets: the operator's
(security.existingSecret) or the hook Job's (templates/credentials-job.yaml).
*/}}
{{- define "kvpool.credentialsDir" -}}
/var/run/secrets/kvpool
{{- end }}

{{- define "kvpool.credentialsPrefix" -}}
{{- default (printf "%s-credentials" (include "kvpool.fullname" .)) .Values.security.existingSecret }}
{{- end }}

{{/* "true" when the chart's hook Job issues the credentials, else empty. */}}
{{- define "kvpool.issuesCredentials" -}}
{{- if and .Values.security.enabled (not .Values.security.existingSecret) }}true{{ end }}
{{- end }}

{{/* The store nodes' ids, one per line: the StatefulSet's pod names, and security.nodeNames. */}}
{{- define "kvpool.nodeIds" -}}
{{- $n := .Values.storeNode }}
{{- if eq $n.kind "StatefulSet" }}
{{- $name := include "kvpool.componentName" (dict "ctx" . "component" "store-node") }}
{{- range $i := until (int $n.replicas) }}
{{ printf "%s-%d" $name $i }}
{{- end }}
{{- end }}
{{- range .Values.security.nodeNames }}
{{ . }}
{{- end }}
{{- end }}

{{/* "true" when each store-node pod gets a certificate of its own from cert-manager's csi-driver
(security.nodeCertificates: certManager), else empty. */}}
{{- define "kvpool.nodeCertsFromCertManager" -}}
{{- if and .Values.security.enabled (eq .Values.security.nodeCertificates "certManager") }}true{{ end }}
{{- end }}

{{/* The issuer of the store nodes' certificates: security.certManager.issuer's, else the chart's. */}}
{{- define "kvpool.nodeIssuerName" -}}
{{- default (include "kvpool.componentName" (dict "ctx" . "component" "ca")) .Values.security.certManager.issuer.name }}
{{- end }}

{{/* A store-node pod's own key and certificate, made on its Kubernetes node by cert-manager's
csi-driver when the pod starts (ca.crt, tls.crt, tls.key: a credentials directory for kvpool),
valid as long as security.days; the key never leaves that node and no other pod has it. */}}
{{- define "kvpool.nodeCertificateVolume" -}}
{{- $issuer := .Values.security.certManager.issuer }}
- name: credentials
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ include "kvpool.nodeIssuerName" . }}
      csi.cert-manager.io/issuer-kind: {{ $issuer.kind }}
      csi.cert-manager.io/issuer-group: {{ $issuer.group }}
      {{- /* The node id is the pod's name (a StatefulSet's: stable across restarts). */}}
      csi.cert-manager.io/common-name: ${POD_NAME}
      csi.cert-manager.io/organizationalunits: node
      csi.cert-manager.io/key-usages: digital signature,key encipherment,client auth,server auth
      csi.cert-manager.io/duration: {{ printf "%dh" (mul .Values.security.days 24) }}
      {{- with .Values.securityContext.fsGroup }}
      {{- /* Readable by the kvpool user, as a Secret's files are (defaultMode 0440). */}}
      csi.cert-manager.io/fs-group: {{ . | quote }}
      {{- end }}
{{- end }}

{{/* A pod's credentials volume: its component's Secret. Called with (dict "ctx" $ "secret" SUFFIX). */}}
{{- define "kvpool.credentialsVolume" -}}
- name: credentials
  secret:
    secretName: {{ printf "%s-%s" (include "kvpool.credentialsPrefix" .ctx) .secret }}
    # Readable by the kvpool user (fsGroup), by nobody else.
    defaultMode: 0440
{{- end }}

{{- define "kvpool.credentialsMount" -}}
- name: credentials
  mountPath: {{ include "kvpool.credentialsDir" . }}
  readOnly: true
{{- end }}
