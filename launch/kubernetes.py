"""Write the Kubernetes manifest of a hetero-parallel training job: a Kubeflow training-operator
``PyTorchJob`` (kubeflow.org/v1) of one pod per node, each running one torchrun agent.

    python launch/kubernetes.py --name gpt-3d --image registry.example.com/hetero-parallel:0.2 \\
        --nodes 4 --gpus-per-node 8 -- parallel=hybrid_3d trainer.max_steps=5000 \\
        | kubectl apply -f -

The operator starts ``--nodes`` pods (one ``Master``, the rest ``Worker``) and gives each the
address of the master pod (``MASTER_ADDR``/``MASTER_PORT``), where torchrun's c10d rendezvous
runs. ``--max-restarts`` restarts a failed job inside the pods (torchrun) and, past that, the
operator recreates pods (``backoffLimit``); either way the run resumes from its newest checkpoint
(``trainer.resume_from=auto``) in the shared volume ``--outputs-claim`` mounts at ``outputs/``
(a ReadWriteMany PersistentVolumeClaim: every pod writes its part of each checkpoint there).
Ascend NPUs: ``--accelerator-resource huawei.com/Ascend910``. docs/multi-node.md has the network
and security notes.

Written as a program rather than a template so that what ``kubectl`` receives is always valid
YAML (PyYAML dumps it) and the pod count, the rendezvous and the recipe's arguments agree.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from typing import Any

import yaml

RDZV_PORT = 29500


def _container(args: argparse.Namespace, recipe_args: list[str]) -> dict[str, Any]:
    # "pytorch": the container the operator gives MASTER_ADDR, MASTER_PORT and the rest
    torchrun = [
        "python", "-m", "torch.distributed.run", f"--nnodes={args.nodes}",
        f"--nproc-per-node={args.gpus_per_node or 1}", "--rdzv-backend=c10d",
        "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)", f"--rdzv-id={args.name}",
        f"--max-restarts={args.max_restarts}", args.recipe,
        f"trainer.run_name={args.name}", "trainer.resume_from=auto", *recipe_args]
    limits = {args.accelerator_resource: args.gpus_per_node} if args.gpus_per_node else {}
    return {
        "name": "pytorch", "image": args.image, "workingDir": args.workdir,
        "command": torchrun,  # Kubernetes expands $(MASTER_ADDR) from the pod's environment
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
        "resources": {"limits": limits},
        "volumeMounts": [{"name": "outputs", "mountPath": f"{args.workdir}/outputs"},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }


def manifest(args: argparse.Namespace, recipe_args: list[str]) -> dict[str, Any]:
    """The ``PyTorchJob`` for ``args`` (see :func:`parser`) running the recipe with
    ``recipe_args``."""
    pod = {"spec": {
        "containers": [_container(args, recipe_args)],
        "volumes": [
            {"name": "outputs", "persistentVolumeClaim": {"claimName": args.outputs_claim}},
            # the DataLoader's and NCCL's shared memory: the default 64 MiB is too small
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if args.nodes > 1:
        replicas["Worker"] = {"replicas": args.nodes - 1, "restartPolicy": "OnFailure",
                              "template": copy.deepcopy(pod)}
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": args.name},
        "spec": {"runPolicy": {"backoffLimit": args.backoff_limit,
                               "cleanPodPolicy": "Running"},
                 "pytorchReplicaSpecs": replicas},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] -- RECIPE_ARGS...")
    p.add_argument("--name", required=True, help="the job's name (and its run's)")
    p.add_argument("--image", required=True, help="a container image holding this repository")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="ranks per node (accelerators per pod; 0: a CPU job of one rank a pod)")
    p.add_argument("--accelerator-resource", default="nvidia.com/gpu")
    p.add_argument("--recipe", default="recipes/train.py")
    p.add_argument("--workdir", default="/workspace/hetero-parallel",
                   help="the repository's directory in the image")
    p.add_argument("--outputs-claim", default="hetero-parallel-outputs",
                   help="a ReadWriteMany PersistentVolumeClaim for outputs/ (checkpoints)")
    p.add_argument("--max-restarts", type=int, default=1, help="torchrun's, inside the pods")
    p.add_argument("--backoff-limit", type=int, default=3, help="the operator's, pod restarts")
    return p


def main(argv: list[str]) -> str:
    ours, recipe_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    args = parser().parse_args(ours)
    if args.nodes < 1 or args.gpus_per_node < 0:
        parser().error(f"--nodes={args.nodes} must be >= 1 and --gpus-per-node="
                       f"{args.gpus_per_node} >= 0")
    header = f"# python launch/kubernetes.py {shlex.join(argv)}\n"
    return header + yaml.safe_dump(manifest(args, recipe_args), sort_keys=False)


if __name__ == "__main__":
    print(main(sys.argv[1:]), end="")
