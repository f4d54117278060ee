"""`trainmesh k8s`: manifests that train a config on Kubernetes, as a Kubeflow PyTorchJob or a JobSet; every pod runs
`trainmesh run` and reads the job's shape from the PET_* variables set for it.

Details: docs/internals.md#appsschedulerskubernetespy
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from trainmesh.apps.schedulers.common import SchedulerError, agent_shutdown_timeout, cpus_per_rank, positive
from trainmesh.core.env import DEFAULT_MASTER_PORT

CONFIG_DIR = "/etc/trainmesh"
RUNS_DIR = "/runs"  # where --pvc is mounted, and run.out_dir then
PYTORCHJOB_PORT = 23456  # training operator's default for the port named pytorchjob-port
JOBSET_PORT = DEFAULT_MASTER_PORT
JOBSET_JOB = "node"  # the replicated job's name: pods are <name>-node-0-<index>
KINDS = ("pytorchjob", "jobset")
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # a DNS-1035 label, as both operators require
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")  # namespaces and claims: DNS-1123 names
NAME_MAX = 40  # pod names add up to 23 characters (`-node-0-<index>`), and a label is at most 63
RANK_MEMORY_GI = 16
"""Host memory a rank is given by default: torch and CUDA's host side, pinned batches, and a checkpoint's copy on the
host while it is written (more for a large model's shards: --memory)."""
WORKER_MEMORY_GI = 2
"""And each of its DataLoader workers: a fork of the rank, and the batches it passes through /dev/shm."""
_CPUS = re.compile(r"\d+(\.\d+)?|\d+m")  # Kubernetes CPU quantities: cores, or thousandths of one (7500m)
_MEMORY = re.compile(r"\d+(\.\d+)?([KMGTPE]i|[kMGTPE]|[eE]\d+)?")  # bytes, binary or decimal units, or 1e9
_YAML_BREAKS = "\x85\u2028\u2029"  # line breaks to YAML 1.1 besides \n and \r


@dataclass(frozen=True)
class K8sJob:
    """What the manifests ask for and run; `check` refuses what cannot work, naming the flag."""

    recipe: str
    config_toml: str
    name: str
    image: str
    nodes: int
    gpus_per_node: int
    kind: str = "pytorchjob"
    min_nodes: int | None = None
    max_nodes: int | None = None
    max_restarts: int = 3
    namespace: str | None = None
    pvc: str | None = None
    """A PersistentVolumeClaim (ReadWriteMany) mounted at RUNS_DIR for the run folders."""
    grace_seconds: int = 120
    """The pods' terminationGracePeriodSeconds: between Kubernetes' SIGTERM (preemption, eviction, deletion) and
    its SIGKILL; torchrun's agent gives its ranks all of it but a margin to save (--shutdown-timeout)."""
    cpus: str | None = None
    """CPUs of a pod (a Kubernetes quantity); None: a core for each rank and each of its loader workers."""
    memory: str | None = None
    """Memory of a pod (a Kubernetes quantity); None: RANK_MEMORY_GI a rank, WORKER_MEMORY_GI a loader worker."""
    num_workers: int = 0
    """The config's data.num_workers: DataLoader worker processes of each rank."""

    @property
    def node_range(self) -> tuple[int, int]:
        return self.min_nodes or self.nodes, self.max_nodes or self.nodes

    @property
    def pod_cpus(self) -> str:
        """--cpus, or what the ranks of a pod and their loader workers need to keep the GPUs fed."""
        return self.cpus or str(self.gpus_per_node * cpus_per_rank(self.num_workers))

    @property
    def pod_memory(self) -> str:
        """--memory, or a floor for the ranks of a pod and their loader workers (a pod over its limit is killed)."""
        return self.memory or f"{self.gpus_per_node * (RANK_MEMORY_GI + self.num_workers * WORKER_MEMORY_GI)}Gi"

    def check(self) -> None:
        if self.kind not in KINDS:
            raise SchedulerError(f"--kind={self.kind!r}: expected one of {', '.join(KINDS)}")
        if not _NAME.fullmatch(self.name) or len(self.name) > NAME_MAX:
            raise SchedulerError(
                f"--name={self.name!r}: expected a DNS label (lower-case letters, digits and '-', starting with a "
                f"letter) of at most {NAME_MAX} characters: pod and service names are built from it"
            )
        for flag, value in (("--namespace", self.namespace), ("--pvc", self.pvc)):
            if value is not None and (not _DNS_NAME.fullmatch(value) or len(value) > 253):
                raise SchedulerError(
                    f"{flag}={value!r}: expected a Kubernetes name (lower-case letters, digits, '-' and '.', starting "
                    "and ending with a letter or digit)"
                )
        if not self.image or any(c.isspace() for c in self.image):
            raise SchedulerError(f"--image={self.image!r}: expected a container image with trainmesh installed")
        positive(self.nodes, "--nodes")
        positive(self.gpus_per_node, "--gpus-per-node")
        if self.max_restarts < 0:
            raise SchedulerError(f"--max-restarts={self.max_restarts}: must be 0 or more")
        positive(self.grace_seconds, "--grace-seconds")
        if self.cpus is not None and not (_CPUS.fullmatch(self.cpus) and _nonzero(self.cpus)):
            raise SchedulerError(
                f"--cpus={self.cpus!r} is not a number of CPUs Kubernetes reads. Fix: cores (8, 7.5) or thousandths "
                "of a core (7500m), more than 0."
            )
        if self.memory is not None and not (_MEMORY.fullmatch(self.memory) and _nonzero(self.memory)):
            hint = " (m is milli, a thousandth of a byte: Mi or M is mega)" if self.memory.endswith("m") else ""
            raise SchedulerError(
                f"--memory={self.memory!r} is not an amount of memory Kubernetes reads{hint}. Fix: a number with a "
                "binary unit Ki, Mi, Gi, Ti (256Gi) or a decimal one k, M, G, T (275G), or of bytes, more than 0."
            )
        low, high = self.node_range
        if self.kind == "jobset" and (self.min_nodes is not None or self.max_nodes is not None):
            raise SchedulerError(
                "--min-nodes/--max-nodes make the job elastic, which a JobSet (a fixed number of pods) cannot be. "
                "Fix: --kind pytorchjob, or drop them."
            )
        if not 1 <= low <= self.nodes <= high:
            raise SchedulerError(
                f"--min-nodes={low} --nodes={self.nodes} --max-nodes={high}: need 1 <= --min-nodes <= --nodes <= "
                "--max-nodes"
            )


def _nonzero(quantity: str) -> bool:
    """The quantity's number is more than 0: Kubernetes takes a request of 0 as none at all."""
    return any(c in "123456789" for c in re.split(r"[a-zA-Z]", quantity, maxsplit=1)[0])


class _Dumper(yaml.SafeDumper):
    """safe_dump's dumper that writes a multi-line string as a literal block (`|`), line by line as in its file, and
    never an anchor and alias for a value written twice. PyYAML itself falls back to a quoted string where a block
    could not hold the text exactly (trailing spaces on a line, tabs and other control characters)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    """A string with a newline as a literal block: the ConfigMap's config.toml reads as the file does."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _represent_str)


def render_manifests(job: K8sJob, checked: list[str], command_line: str) -> str:
    """A ConfigMap holding the config and the PyTorchJob or JobSet that trains it, as one YAML stream."""
    job.check()
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, f"{job.name}-config"),
        "data": {"config.toml": job.config_toml},
    }
    trainer = _pytorchjob(job) if job.kind == "pytorchjob" else _jobset(job)
    header = [f"# Generated by: {command_line}", *(f"# checked: {line}" for line in checked)]
    header.append("# Apply with: kubectl apply -f <this file>")
    # Non-ASCII text as it is, unless the config holds a character YAML reads as a line break (PyYAML would write
    # it raw and read back a newline): then everything but ASCII is escaped.
    as_is = not any(c in job.config_toml for c in _YAML_BREAKS)
    documents = yaml.dump_all(
        [config_map, trainer], Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=as_is
    )
    assert next(yaml.safe_load_all(documents))["data"]["config.toml"] == job.config_toml  # the config, exactly
    return "\n".join(header) + "\n" + documents


def _metadata(job: K8sJob, name: str) -> dict[str, Any]:
    return {"name": name, **({"namespace": job.namespace} if job.namespace else {})}


def _command(job: K8sJob) -> list[str]:
    """`trainmesh run`; what the operator's PET_ variables say (nodes, rendezvous, restarts) is left to them."""
    return [
        "trainmesh",
        "run",
        job.recipe,
        "--config",
        f"{CONFIG_DIR}/config.toml",
        "--nproc-per-node",
        str(job.gpus_per_node),
        "--run-id",
        job.name,
        "--auto-resume",  # a restarted pod continues from the run's newest checkpoint
        "--shutdown-timeout",  # after a SIGTERM, the ranks save within the pod's grace period
        str(agent_shutdown_timeout(job.grace_seconds)),
    ]


def _pod_spec(job: K8sJob, container: dict[str, Any], restart_policy: str) -> dict[str, Any]:
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, {"name": "shm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{job.name}-config"}},
        # Data loader workers and NCCL share memory through /dev/shm, 64 MiB by default in a container.
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    if job.pvc:
        mounts.append({"name": "runs", "mountPath": RUNS_DIR})
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": job.pvc}})
    container = {
        **container,
        "image": job.image,
        "command": _command(job),
        # Limits equal to the requests: QoS class Guaranteed, the last a node evicts, and with the kubelet's static CPU
        # manager whole cores of its own (an integer --cpus). Memory-backed /dev/shm counts in the memory.
        "resources": {
            "requests": {"cpu": job.pod_cpus, "memory": job.pod_memory},
            "limits": {"cpu": job.pod_cpus, "memory": job.pod_memory, "nvidia.com/gpu": job.gpus_per_node},
        },
        "volumeMounts": mounts,
    }
    return {
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": job.grace_seconds,
        "containers": [container],
        "volumes": volumes,
    }


def _pytorchjob(job: K8sJob) -> dict[str, Any]:
    low, high = job.node_range
    # The operator finds the rendezvous port by these names (getPortFromPyTorchJob).
    container = {"name": "pytorch", "ports": [{"name": "pytorchjob-port", "containerPort": PYTORCHJOB_PORT}]}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job, job.name),
        "spec": {
            "nprocPerNode": str(job.gpus_per_node),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": low,
                "maxReplicas": high,
                "maxRestarts": job.max_restarts,  # PET_MAX_RESTARTS: torchrun restarts the pod's processes
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": job.nodes,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": _pod_spec(job, container, "OnFailure")},
                }
            },
        },
    }


def _jobset(job: K8sJob) -> dict[str, Any]:
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    env = [
        {"name": "PET_NNODES", "value": str(job.nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(job.gpus_per_node)},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}},
        # Pod <jobset>-<job>-<job index>-<pod index> in the JobSet's subdomain (its headless service).
        {"name": "PET_MASTER_ADDR", "value": f"{job.name}-{JOBSET_JOB}-0-0.{job.name}"},
        {"name": "PET_MASTER_PORT", "value": str(JOBSET_PORT)},
    ]
    container = {"name": "trainer", "env": env, "ports": [{"containerPort": JOBSET_PORT}]}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(job, job.name),
        "spec": {
            # A failed pod fails its Job (backoffLimit 0), and the JobSet restarts every pod together.
            "failurePolicy": {"maxRestarts": job.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": job.name},
            "replicatedJobs": [
                {
                    "name": JOBSET_JOB,
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": job.nodes,
                            "completions": job.nodes,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"spec": _pod_spec(job, container, "Never")},
                        }
                    },
                }
            ],
        },
    }
