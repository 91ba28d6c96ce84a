"""Label and annotation keys shared by the objects we emit (upstream names, kept in one place)."""

TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
NODEPOOL = "cloud.google.com/gke-nodepool"
DRANET_NODE = "cloud.google.com/gke-networking-dra-driver"
TPU_RESOURCE = "google.com/tpu"
SPOT = "cloud.google.com/gke-spot"
# Nodes of a queued-provisioning (flex-start) pool carry this label and a NoSchedule taint of the same key, both
# "true" (xpk src/xpk/core/capacity.py selects on it; GKE's flex-start node pools are created with the taint).
QUEUED = "cloud.google.com/gke-queued"

KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY = "kueue.x-k8s.io/priority-class"

JOBSET_EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"

GCSFUSE_INJECT = "gke-gcsfuse/volumes"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
WORKLOAD_IDENTITY_GSA = "iam.gke.io/gcp-service-account"

# infra/components/cluster.py puts it on the CPU system pool; the Ray head and its Kueue flavor select it.
SYSTEM_POOL = {"gke-tpu-rl/pool": "system"}

MANAGED_BY = {"app.kubernetes.io/managed-by": "gke-tpu-rl"}
