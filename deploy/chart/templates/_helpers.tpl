{{- define "avspec.name" -}}
{{- printf "%s-avspec" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "avspec.selector" -}}
app.kubernetes.io/name: avspec
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "avspec.labels" -}}
{{ include "avspec.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "avspec.checks" -}}
{{- $tp := .Values.tensorParallel -}}
{{- if ne (mod (int $tp.size) (int $tp.nodes)) 0 -}}
{{- fail (printf "tensorParallel.size (%d) must be a multiple of tensorParallel.nodes (%d)" (int $tp.size) (int $tp.nodes)) -}}
{{- end -}}
{{- if and (gt (int $tp.nodes) 1) (not .Values.engine.claimName) -}}
{{- fail "tensorParallel.nodes > 1 needs engine.claimName: a volume every pod of a group reads the engine from" -}}
{{- end -}}
{{- if and .Values.estimator.prior.configMap .Values.estimator.prior.claimName -}}
{{- fail "estimator.prior: give configMap or claimName, not both" -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" -}}
{{- end -}}
{{- end -}}

{{/* GPUs per pod: all TP ranks in one pod, or size/nodes ranks per pod of a group */}}
{{- define "avspec.gpusPerPod" -}}
{{- div (int .Values.tensorParallel.size) (int .Values.tensorParallel.nodes) -}}
{{- end -}}

{{/* The serving container: rank 0 of the MPI group (the only one in a single-node pod). */}}
{{- define "avspec.servingContainer" -}}
- name: triton
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["bash", "/etc/avspec/scripts/start.sh"]
  env:
    - name: AVSPEC_TARGET_MODEL
      value: "/mnt/models/{{ .Values.models.target }}"
    - name: AVSPEC_DRAFT_MODEL
      value: "/mnt/models/{{ .Values.models.draft }}"
    - name: AVSPEC_GPU_VALUES
      value: /etc/avspec/values/gpu_values.json
    - name: AVSPEC_NUM_DRAFT_TOKENS
      value: {{ .Values.speculative.numDraftTokens | quote }}
    - name: AVSPEC_TP_SIZE
      value: {{ .Values.tensorParallel.size | quote }}
    - name: AVSPEC_COST_TABLES
      value: {{ if .Values.costTables.configMap }}"/etc/avspec/costs/{{ .Values.costTables.key }}"{{ else }}/mnt/models/cost_tables_gpu.json{{ end }}
    {{- if or .Values.estimator.prior.configMap .Values.estimator.prior.claimName }}
    - name: AVSPEC_PRIOR
      value: "/etc/avspec/prior/{{ .Values.estimator.prior.key }}"
    {{- end }}
    {{- if gt (int .Values.tensorParallel.nodes) 1 }}
    - name: AVSPEC_MPI_NODES
      value: {{ .Values.tensorParallel.nodes | quote }}
    - name: AVSPEC_LWS_NAME
      value: {{ include "avspec.name" . }}
    {{- end }}
    # the Host names the front answers besides IPs and localhost: the Service's names
    - name: AVSPEC_ALLOWED_HOSTS
      value: "{{ include "avspec.name" . }},{{ include "avspec.name" . }}.{{ .Release.Namespace }},{{ include "avspec.name" . }}.{{ .Release.Namespace }}.svc,{{ include "avspec.name" . }}.{{ .Release.Namespace }}.svc.cluster.local"
    {{- if .Values.adminKeySecret }}
    - name: AVSPEC_ADMIN_KEY
      valueFrom:
        secretKeyRef:
          name: {{ .Values.adminKeySecret }}
          key: admin-key
    {{- end }}
  ports:
    - name: http
      containerPort: 8000
    - name: grpc
      containerPort: 8001
    - name: metrics
      containerPort: 8002
  startupProbe:
    httpGet:
      path: /v2/health/ready
      port: http
    periodSeconds: {{ .Values.probes.startup.periodSeconds }}
    failureThreshold: {{ .Values.probes.startup.failureThreshold }}
  readinessProbe:
    httpGet:
      path: /v2/health/ready
      port: http
    periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
    failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  livenessProbe:
    httpGet:
      path: /v2/health/live
      port: http
    periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
    failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  resources:
    requests:
      cpu: {{ .Values.resources.cpu | quote }}
      memory: {{ .Values.resources.memory | quote }}
      nvidia.com/gpu: {{ include "avspec.gpusPerPod" . }}
    limits:
      memory: {{ .Values.resources.memory | quote }}
      nvidia.com/gpu: {{ include "avspec.gpusPerPod" . }}
  volumeMounts:
    - name: models
      mountPath: /mnt/models
      readOnly: true
    - name: pod-models
      mountPath: /opt/avspec/models
    - name: engines
      mountPath: /engines
    - name: runs
      mountPath: /opt/avspec/runs
    - name: shm
      mountPath: /dev/shm
    - name: scripts
      mountPath: /etc/avspec/scripts
      readOnly: true
    - name: values
      mountPath: /etc/avspec/values
      readOnly: true
    {{- if .Values.costTables.configMap }}
    - name: costs
      mountPath: /etc/avspec/costs
      readOnly: true
    {{- end }}
    {{- if or .Values.estimator.prior.configMap .Values.estimator.prior.claimName }}
    - name: prior
      mountPath: /etc/avspec/prior
      readOnly: true
    {{- end }}
{{- end -}}

{{- define "avspec.volumes" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.claimName }}
    readOnly: true
- name: pod-models
  emptyDir: {}
- name: engines
  {{- if .Values.engine.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.engine.claimName }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .Values.engine.sizeLimit }}
  {{- end }}
- name: runs
  emptyDir: {}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.resources.sharedMemory }}
- name: scripts
  configMap:
    name: {{ include "avspec.name" . }}-scripts
- name: values
  configMap:
    name: {{ include "avspec.name" . }}-values
{{- if .Values.costTables.configMap }}
- name: costs
  configMap:
    name: {{ .Values.costTables.configMap }}
{{- end }}
{{- if .Values.estimator.prior.configMap }}
- name: prior
  configMap:
    name: {{ .Values.estimator.prior.configMap }}
{{- else if .Values.estimator.prior.claimName }}
- name: prior
  persistentVolumeClaim:
    claimName: {{ .Values.estimator.prior.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "avspec.podExtras" -}}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
