"""deploy/k8s and deploy/slurm agree with the code: fast, static checks; no cluster, no Docker.

Every Kubernetes document parses and is named; every ``libra-ctl`` command in a
container or in the sbatch script parses with the real parser
(``pipeline.cli.build_parser``); the environment variables they set are ones
the code reads; the controller runs two replicas, the agent holds GPUs and its
node's name, Redis keeps an AOF and never evicts, and the shared run directory
is one path in every pod. What these files do on a real cluster is not tested
here (deploy/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline import config as config_mod
from pipeline.cli import build_parser
from pipeline.dataplane.keys import AGENTS, CONTROLLER_LEASE

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SBATCH = DEPLOY / "slurm" / "libra.sbatch"
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
SOURCE = "\n".join(p.read_text() for d in ("pipeline", "workers") for p in sorted((ROOT / d).rglob("*.py")))


# --- helpers ---------------------------------------------------------------------------------------


def k8s_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml")):
        with path.open() as f:
            docs += [(path, d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


def one(kind: str, name: str) -> dict:
    found = [d for _p, d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def libra_containers() -> list[tuple[dict, dict]]:
    """(workload, container) for every container whose command starts with libra-ctl."""
    out = []
    for _p, doc in k8s_docs():
        if doc["kind"] in WORKLOADS:
            spec = pod_spec(doc)
            for c in spec.get("initContainers", []) + spec["containers"]:
                if (c.get("command") or [None])[0] == "libra-ctl":
                    out.append((doc, c))
    return out


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def parse_libra(argv: list[str], where: str) -> argparse.Namespace:
    """``libra-ctl ARGV`` through the real parser; a rejected argument fails the test."""
    assert argv and argv[0] in subcommands(), f"{where}: libra-ctl {argv[:1]} is not a subcommand"
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: libra-ctl {' '.join(argv)} is rejected by the parser (exit {exc.code})")


def read_by_code(name: str) -> bool:
    return f'"{name}"' in SOURCE or f"'{name}'" in SOURCE


def redis_conf(text: str) -> dict[str, str]:
    conf = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            conf[key.lower()] = value.strip()
    return conf


# --- Kubernetes ------------------------------------------------------------------------------------


def test_every_k8s_document_parses_and_is_named():
    docs = k8s_docs()
    kinds = {d["kind"] for _p, d in docs}
    assert {"StatefulSet", "Deployment", "DaemonSet", "Job", "ConfigMap", "Service",
            "PersistentVolumeClaim", "Secret"} <= kinds
    for path, doc in docs:
        where = f"{path.relative_to(ROOT)}: {doc.get('kind')}"
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], where
        assert isinstance(doc.get("kind"), str) and doc["kind"], where
        assert isinstance(doc.get("metadata", {}).get("name"), str) and doc["metadata"]["name"], where
        if doc["kind"] in WORKLOADS and doc["kind"] != "Job":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), where


def test_libra_commands_parse_with_the_real_cli():
    used = set()
    for doc, c in libra_containers():
        argv = c["command"][1:] + c.get("args", [])
        ns = parse_libra(argv, f"{doc['kind']} {doc['metadata']['name']}")
        used.add(ns.command)
    assert used == {"controller", "agent", "run"}


def test_env_vars_are_ones_the_code_reads():
    for doc, c in libra_containers():
        where = f"{doc['kind']} {doc['metadata']['name']}"
        names = [e["name"] for e in c.get("env", [])]
        for name in names:
            assert read_by_code(name), f"{where}: env {name} is not read anywhere in pipeline/ or workers/"
        # Kubernetes leaves $(VAR) as it is when VAR is not in the container's env
        for ref in re.findall(r"\$\((\w+)\)", " ".join(c["command"] + c.get("args", []))):
            assert ref in names, f"{where}: $({ref}) in the command but not in env"
        assert "LIBRA_REDIS_URL" in names, where


def test_controller_deployment_runs_two_replicas():
    ctl = one("Deployment", "libra-controller")
    assert ctl["spec"]["replicas"] == 2
    assert "lease" in (K8S / "30-controller.yaml").read_text()   # the comment says why two is safe
    (c,) = pod_spec(ctl)["containers"]
    assert c["command"][:2] == ["libra-ctl", "controller"]
    # the URL (with its password) comes from the Secret in the environment, never on the command line
    assert "--redis" not in c["command"] and {e["name"] for e in c["env"]} >= {"LIBRA_REDIS_URL"}
    assert c["command"][c["command"].index("--metrics-host") + 1] == "0.0.0.0"   # Prometheus scrapes the Pod


def test_agent_daemonset_holds_gpus_and_names_its_node():
    ds = one("DaemonSet", "libra-agent")
    spec = pod_spec(ds)
    (c,) = spec["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1   # an extended resource goes in limits
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert "nvidia.com/gpu.present" in keys
    argv = c["command"]
    assert argv[argv.index("--node") + 1] == "$(LIBRA_NODE)"
    assert "--redis" not in argv   # the URL is read from LIBRA_REDIS_URL, off the command line
    env = {e["name"]: e for e in c["env"]}
    assert env["LIBRA_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert int(spec["terminationGracePeriodSeconds"]) > float(argv[argv.index("--grace") + 1])


def agent_record(node: str) -> str:
    return json.dumps({"node": node, "host": node, "pid": 1, "started_at": time.time(), "heartbeat": time.time(),
                       "slots": [{"index": 0, "device": "0"}]})


def run_snippet(code: str, args: list[str], url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LIBRA_REDIS_URL": url}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_job_waits_for_the_controller_and_an_agent(r, redis_url):
    """libra-ctl run joins a live controller and agents; the Job's init container waits until they are there."""
    job = one("Job", "libra-run")
    spec = pod_spec(job)
    (run,) = spec["containers"]
    assert "nvidia.com/gpu" not in str(run.get("resources"))   # the workers run under the agents
    (init,) = spec["initContainers"]
    assert init["command"][:2] == ["python", "-c"] and "LIBRA_REDIS_URL" in {e["name"] for e in init["env"]}
    code, want, _wait_s = init["command"][2:]
    assert run_snippet(code, [want, "0"], redis_url).returncode == 1           # nothing live yet
    r.hset(AGENTS, "gpu-01", agent_record("gpu-01"))
    assert run_snippet(code, [want, "0"], redis_url).returncode == 1           # no controller
    r.set(CONTROLLER_LEASE, "1:token")
    res = run_snippet(code, [want, "0"], redis_url)
    assert res.returncode == 0, res.stdout + res.stderr


def test_redis_keeps_an_aof_and_never_evicts():
    cm = one("ConfigMap", "libra-redis-config")
    conf = redis_conf(cm["data"]["redis.conf"])
    assert conf["appendonly"] == "yes"
    assert conf["maxmemory-policy"] == "noeviction"
    host = redis_conf((DEPLOY / "redis.conf").read_text())
    for key in ("appendonly", "appendfsync", "save", "maxmemory-policy", "aof-use-rdb-preamble", "appendfilename"):
        assert conf[key] == host[key], f"{key}: deploy/k8s says {conf[key]!r}, deploy/redis.conf {host[key]!r}"

    sts = one("StatefulSet", "libra-redis")
    spec = pod_spec(sts)
    (c,) = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    conf_volume = next(n for n, v in volumes.items() if v.get("configMap", {}).get("name") == "libra-redis-config")
    assert f"{mounts[conf_volume]}/redis.conf" in c["command"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert mounts[claim["metadata"]["name"]] == conf["dir"]   # the AOF is on the claimed volume
    assert "$(REDIS_PASSWORD)" in c["command"] and "REDIS_PASSWORD" in {e["name"] for e in c["env"]}

    svc = one("Service", "libra-redis")
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    secret = one("Secret", "libra-redis")["stringData"]
    url = secret["url"]
    assert url.startswith("redis://") and f":{secret['password']}@libra-redis:{svc['spec']['ports'][0]['port']}/" in url


def test_the_shared_run_directory_is_one_path_everywhere(tmp_path):
    pvc = one("PersistentVolumeClaim", "libra-shared")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    paths = set()
    for doc, c in libra_containers():
        volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
        shared = [m["mountPath"] for m in c["volumeMounts"]
                  if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == "libra-shared"]
        assert len(shared) == 1, f"{doc['kind']} {doc['metadata']['name']} does not mount libra-shared once"
        paths.update(shared)
    (mount,) = paths

    # the job's config: a valid config whose run directories and policies are on the shared volume
    job = one("Job", "libra-run")
    spec = pod_spec(job)
    (c,) = spec["containers"]
    ns = parse_libra(c["command"][1:], "Job libra-run")
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_mounts = [(m["mountPath"], volumes[m["name"]]["configMap"]["name"]) for m in c["volumeMounts"]
                     if "configMap" in volumes[m["name"]]]
    (cm_path, cm_name) = next((p, n) for p, n in config_mounts if ns.config.startswith(p + "/"))
    text = one("ConfigMap", cm_name)["data"][ns.config[len(cm_path) + 1:]]
    (tmp_path / "job.toml").write_text(text)
    cfg = config_mod.load(tmp_path / "job.toml")
    assert cfg.run.runs_dir.startswith(mount + "/")
    assert cfg.policy.cache_dir.startswith(mount + "/")
    assert not cfg.redis.url   # the URL comes from $LIBRA_REDIS_URL (the Secret)
    workdir = c["workingDir"]
    for prompts in (cfg.job.train_prompts, cfg.job.eval_prompts):
        assert prompts.startswith(workdir + "/") and (ROOT / prompts[len(workdir) + 1:]).exists(), prompts

    # every pod runs the image deploy/Dockerfile builds, in its WORKDIR
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"WORKDIR {workdir}" in dockerfile and "-t libra:latest" in dockerfile
    for doc, c in libra_containers():
        assert c["image"] == "libra:latest" and c["workingDir"] == workdir, doc["metadata"]["name"]


# --- Slurm -------------------------------------------------------------------------------------------


def shell_commands(text: str):
    """Simple commands of a shell script, as word lists (good enough for this script, not a shell)."""
    text = re.sub(r"\\\n", " ", text)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\s#\s.*$", "", line)                       # a trailing comment
        line = re.sub(r"\s\d*>>?&?\s*(\"[^\"]*\"|\S+)", " ", line)  # redirections
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, ""
        try:
            tokens = list(lex)
        except ValueError:
            continue
        cmd: list[str] = []
        for t in tokens + [";"]:
            if set(t) <= set(";&|"):
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(t)


def libra_invocations(words: list[str], env: dict, exports: set, outer: tuple = ()):
    """(wrappers, prefix assignments, argv) of each libra-ctl in a simple command, through srun and bash -c."""
    assigns = {}
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        assigns[name] = value
    if words and words[0] == "exec":
        words = words[1:]
    if not words:
        return
    if words[0] == "export":
        exports.update(w.partition("=")[0] for w in words[1:])
    elif words[0] == "srun":
        rest = words[1:]
        n = 0
        while n < len(rest) and rest[n].startswith(("-", "${")):
            n += 1   # srun's options, some from an array expansion
        opts = rest[:n]
        yield from libra_invocations(rest[n:], {**env, **assigns}, exports, outer + (("srun", tuple(opts)),))
    elif words[0] == "bash" and "-c" in words:
        for cmd in shell_commands(words[words.index("-c") + 1]):
            yield from libra_invocations(cmd, {**env, **assigns}, exports, outer + (("bash",),))
    elif words[0] == "libra-ctl":
        argv = [w for w in words[1:] if w != "$@" and not re.fullmatch(r"\$\{\w+\[@\]\}", w)]
        yield outer, {**env, **assigns}, argv


def sbatch_invocations():
    exports: set = set()
    found = [inv for cmd in shell_commands(SBATCH.read_text()) for inv in libra_invocations(cmd, {}, exports)]
    return found, exports


def test_sbatch_script_passes_bash_n():
    res = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_sbatch_libra_commands_parse_with_the_real_cli():
    found, _ = sbatch_invocations()
    used = {}
    for outer, _env, argv in found:
        ns = parse_libra(argv, f"{SBATCH.relative_to(ROOT)}")
        used[ns.command] = outer
    assert set(used) == {"agent", "controller", "run", "resume"}
    # one agent on every node of the allocation, started through srun
    (srun,) = [o for o in used["agent"] if o[0] == "srun"]
    assert "--ntasks-per-node=1" in srun[1] and '--nodes=${#NODES[@]}' in srun[1]
    assert not any(o.startswith(("--exclude", "-x")) for o in srun[1])


def test_sbatch_starts_the_run_once_every_agent_is_live(r, redis_url):
    """The script's wait for the agents (before libra-ctl run, which joins them) against a real Redis."""
    text = SBATCH.read_text()
    (code,) = re.findall(r"python -c '(.*?)' \"\$\{#NODES\[@\]\}\"", text, re.S)
    assert text.index(code) < text.rindex("libra-ctl run ")   # the command, after the comments
    assert run_snippet(code, ["2", "0"], redis_url).returncode == 1
    r.hset(AGENTS, "node-1", agent_record("node-1"))
    assert run_snippet(code, ["2", "0"], redis_url).returncode == 1
    r.hset(AGENTS, "node-2", agent_record("node-2"))
    res = run_snippet(code, ["2", "0"], redis_url)
    assert res.returncode == 0 and "2 of 2 agents live" in res.stdout, res.stdout + res.stderr


def test_sbatch_env_vars_are_ones_the_code_reads():
    found, exports = sbatch_invocations()
    names = set(exports)
    for _outer, env, _argv in found:
        names.update(env)
    assert {"LIBRA_REDIS_URL", "LIBRA_GPUS"} <= names
    for name in names - {"PATH"}:
        assert read_by_code(name), f"{SBATCH.name}: {name} is given to libra-ctl but no code reads it"


def test_sbatch_redis_keeps_the_durability_settings():
    """The script starts Redis from deploy/redis.conf less the lines it replaces: AOF and noeviction stay."""
    text = SBATCH.read_text()
    (pattern,) = re.findall(r"grep -vE '([^']+)' \"\$LIBRA_HOME/deploy/redis.conf\"", text)
    kept = "\n".join(line for line in (DEPLOY / "redis.conf").read_text().splitlines()
                     if not re.search(pattern, line))
    conf = redis_conf(kept)
    assert conf["appendonly"] == "yes" and conf["maxmemory-policy"] == "noeviction"
    assert "dir" not in conf and "requirepass" not in conf and "maxmemory" not in conf
