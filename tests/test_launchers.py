"""The launchers in ``launch/``: the Slurm batch script run to a finished training run on a
one-node Slurm started inside the test (where Debian's ``slurm-wlm`` is installed), and the
Kubernetes manifest rendered and parsed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distributed import free_port
from recipe_helpers import ROOT, TINY, losses_of, recipe_env

LAUNCH = ROOT / "launch"


def _slurm_conf(tmp: Path, host: str) -> Path:
    """A one-node cluster on this host: no munge (auth/none), no cgroups, ports of its own."""
    for sub in ("state", "spool", "log"):
        (tmp / sub).mkdir(parents=True)
    conf = tmp / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=hetero_test", f"SlurmctldHost={host}",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={tmp}/state", f"SlurmdSpoolDir={tmp}/spool",
        f"SlurmctldPidFile={tmp}/slurmctld.pid", f"SlurmdPidFile={tmp}/slurmd.pid",
        f"SlurmctldLogFile={tmp}/log/slurmctld.log", f"SlurmdLogFile={tmp}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
        "MpiDefault=none", "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
        ""]))
    return conf


def _stop(pid_file: Path) -> None:
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass


@pytest.mark.slow
def test_the_slurm_script_trains_on_a_one_node_slurm(tmp_path):
    missing = [d for d in ("slurmctld", "slurmd", "sbatch", "scontrol") if not shutil.which(d)]
    if missing:
        pytest.skip(f"Slurm is not installed here ({', '.join(missing)} not found; Debian: "
                    f"apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm of this test runs its daemons as root")
    host = socket.gethostname().split(".")[0]
    conf = _slurm_conf(tmp_path / "slurm", host)
    env = recipe_env(SLURM_CONF=str(conf), NPROC_PER_NODE="2", RDZV_PORT=str(free_port()),
                     PYTHON=sys.executable, HETERO_PARALLEL_ACCELERATOR="none")
    run = tmp_path / "run"
    try:
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(conf)], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, text=True,
                                           capture_output=True).stdout:
            assert time.monotonic() < deadline, (tmp_path / "slurm/log/slurmd.log").read_text()
            time.sleep(0.5)
        out = tmp_path / "job.out"
        job = subprocess.run(
            ["sbatch", "--wait", "--nodes=1", f"--output={out}", str(LAUNCH / "slurm.sbatch"),
             *TINY, "trainer.max_steps=6", "trainer.checkpoint_every=3",
             f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}"],
            cwd=ROOT, env=env, text=True, capture_output=True, timeout=400)
        printed = out.read_text() if out.exists() else ""
        assert job.returncode == 0, f"{job.stdout}\n{job.stderr}\n{printed[-4000:]}"
    finally:
        _stop(tmp_path / "slurm/slurmd.pid")
        _stop(tmp_path / "slurm/slurmctld.pid")
    assert "1 node(s) x 2 rank(s)" in printed and "2 rank(s) on cpu" in printed
    assert sorted(losses_of(run)) == [1, 2, 3, 4, 5, 6]
    assert (run / "checkpoints" / "step_000006").is_dir()


def _render(*argv: str) -> tuple[str, dict]:
    proc = subprocess.run([sys.executable, str(LAUNCH / "kubernetes.py"), *argv],
                          capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout, yaml.safe_load(proc.stdout)


def test_the_kubernetes_manifest_renders_a_pytorchjob_of_one_pod_per_node():
    text, job = _render("--name", "gpt-3d", "--image", "registry.example.com/hp:0.2",
                        "--nodes", "4", "--gpus-per-node", "8", "--",
                        "parallel=hybrid_3d", "trainer.max_steps=5000")
    assert text.startswith("# python launch/kubernetes.py --name gpt-3d")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 4
    for role in ("Master", "Worker"):
        pod = replicas[role]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the one the operator gives MASTER_ADDR
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        command = container["command"]
        assert command[:3] == ["python", "-m", "torch.distributed.run"]
        assert {"--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)"} <= set(command)
        assert command[-5:] == ["recipes/train.py", "trainer.run_name=gpt-3d",
                                "trainer.resume_from=auto", "parallel=hybrid_3d",
                                "trainer.max_steps=5000"]
        assert {v["name"] for v in pod["volumes"]} == {"outputs", "shm"}
    assert "&id" not in text  # no YAML anchors: each replica spelled out


def test_a_cpu_job_and_an_npu_job_render_and_bad_counts_are_refused():
    _, cpu = _render("--name", "cpu", "--image", "img", "--nodes", "1", "--gpus-per-node", "0")
    spec = cpu["spec"]["pytorchReplicaSpecs"]
    assert list(spec) == ["Master"]
    (container,) = spec["Master"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {} and "--nproc-per-node=1" in container["command"]
    _, npu = _render("--name", "npu", "--image", "img", "--accelerator-resource",
                     "huawei.com/Ascend910")
    limits = npu["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]
    assert limits == {"huawei.com/Ascend910": 8}
    proc = subprocess.run([sys.executable, str(LAUNCH / "kubernetes.py"), "--name", "x",
                           "--image", "i", "--nodes", "0"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--nodes=0 must be >= 1" in proc.stderr
