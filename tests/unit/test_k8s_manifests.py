"""Every manifest under infra/k8s/ and the Jobs of a Kimi-K2.5 run validate against the Kubernetes API schemas
that kubernetes-validate ships (offline; strict: an unknown or misplaced field fails), for the oldest and newest
Kubernetes versions this setup supports. The run's Jobs are rendered by prefect-kubernetes' own worker code from
the pools' job templates with `cluster.job_variables(kimi config, stage)`: four extract groups, verify (a CPU
pod), train and evaluate, and they must request what the config implies. Also: the worker's Role is exactly
what the worker needs, and infra/k8s/prefect.yaml's deployments name pools that infra/k8s/pools.sh creates."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                                          "(the test extra: pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
IMAGE = "registry.example/eagle3-pipeline@sha256:" + "0123456789abcdef" * 4
# the ${VARS} the manifests take (docs/kubernetes.md sets each with envsubst), with sample values
SAMPLE = {"EAGLE3_IMAGE": IMAGE, "PREFECT_API_URL": "http://prefect.example:4200/api",
          "STORE_STORAGE_CLASS": "cephfs", "STORE_SIZE": "100Ti", "MODELS_STORAGE_CLASS": "cephfs",
          "MODELS_SIZE": "4Ti", "MODEL_REPO": "moonshotai/Kimi-K2.5", "MODEL_REVISION": "main",
          "MODEL_DIR": "Kimi-K2.5", "IMAGE_PULL_SECRET": "eagle3-registry"}
NOT_MANIFESTS = {"prefect.yaml"}  # a Prefect deployment file, not a Kubernetes object


def manifest_files() -> list[Path]:
    files = sorted(p for p in K8S.glob("*.yaml") if p.name not in NOT_MANIFESTS)
    assert files, "no manifests under infra/k8s/"
    return files


def load_manifests(path: Path) -> list[dict]:
    text = path.read_text()
    used = set(re.findall(r"\$\{([A-Z0-9_]+)\}", text))
    assert used <= set(SAMPLE), f"{path.name}: unknown variables {sorted(used - set(SAMPLE))} (docs/kubernetes.md)"
    text = re.sub(r"\$\{([A-Z0-9_]+)\}", lambda m: SAMPLE[m.group(1)], text)  # what envsubst '$A $B' does
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert docs, f"{path.name}: no documents"
    return docs


def validate(doc: dict, where: str) -> None:
    from eagle3_pipeline.core.cluster import value_problems

    assert value_problems(doc) == [], f"{where}: values the schema accepts but Kubernetes refuses"
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} ({doc.get('kind')}) is not a valid Kubernetes {version} object: {e.message} "
                        f"at {'.'.join(map(str, e.path))}")


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates(path):
    for doc in load_manifests(path):
        validate(doc, path.name)
        assert doc["metadata"].get("namespace", "eagle3") == "eagle3" or doc["kind"] == "Namespace"


def _objects() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in manifest_files() for d in load_manifests(p)}


def test_the_pieces_docs_kubernetes_md_names_are_all_there():
    objs = _objects()
    store = objs["PersistentVolumeClaim", "eagle3-store"]
    models = objs["PersistentVolumeClaim", "models"]
    assert store["spec"]["accessModes"] == ["ReadWriteMany"] == models["spec"]["accessModes"]
    assert {("Namespace", "eagle3"), ("Secret", "hf-token"), ("Secret", "prefect-auth"),
            ("ServiceAccount", "eagle3-worker"), ("ServiceAccount", "eagle3-job"), ("Role", "eagle3-worker"),
            ("RoleBinding", "eagle3-worker"), ("Deployment", "eagle3-worker"), ("Job", "stage-model"),
            ("ServiceAccount", "eagle3-controller"), ("RoleBinding", "eagle3-controller"), ("Pod", "eagle3-data"),
            ("Deployment", "prefect-server"), ("StatefulSet", "eagle3-postgres"), ("Secret", "prefect-db")} <= set(objs)
    data = objs["Pod", "eagle3-data"]["spec"]  # the data pod: the store, as the stage pods' user, no token
    assert data["securityContext"]["runAsUser"] == 10001 and data["automountServiceAccountToken"] is False
    assert data["volumes"][0]["persistentVolumeClaim"]["claimName"] == "eagle3-store"
    for (kind, name), d in objs.items():
        if kind == "Secret":  # templates only: no value that could be a real one
            assert all(v.startswith("REPLACE_") for v in d["stringData"].values()), name
    staging = objs["Job", "stage-model"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in staging["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "0"  # the one pod that reaches the hub
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": True}


def test_worker_role_allows_exactly_what_the_kubernetes_worker_needs():
    objs = _objects()
    rules = {(g, r): set(rule["verbs"]) for rule in objs["Role", "eagle3-worker"]["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
                     ("", "pods"): {"get", "list", "watch"}, ("", "pods/log"): {"get"},
                     ("", "events"): {"get", "list", "watch", "create", "patch"}}
    assert not any(k == "ClusterRole" for k, _ in objs)
    binding = objs["RoleBinding", "eagle3-worker"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "eagle3-worker", "namespace": "eagle3"}]
    pod = objs["Deployment", "eagle3-worker"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "eagle3-worker"
    pools = set()
    for c in pod["containers"]:
        env = {e["name"]: e for e in c["env"]}
        # namespaced observer (the Role is namespaced) and the auth string as a secretKeyRef in the Jobs
        assert env["PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"]["value"] == "eagle3"
        assert env["PREFECT_API_AUTH_STRING"]["valueFrom"]["secretKeyRef"]["name"] == "prefect-auth"
        assert env["PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME"]["value"] == "prefect-auth"
        pools.add(c["command"][c["command"].index("--pool") + 1])
    assert pools == {"eagle3-gpu", "eagle3-cpu"}
    assert objs["ServiceAccount", "eagle3-job"]["automountServiceAccountToken"] is False


# ------------------------------------------------------------------ the Jobs of a Kimi run


@pytest.fixture(scope="module")
def kimi():
    from eagle3_pipeline.core.config import load_config

    return load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")


def kimi_run_jobs(cfg, given: dict | None = None) -> dict[str, tuple[dict, dict]]:
    """name -> (job variables, rendered Job) of one Kimi run: 100 shards in 4 groups, verify, train, evaluate."""
    pytest.importorskip("prefect_kubernetes")
    from tests.unit.test_k8s_job_template import CPU_TEMPLATE, TEMPLATE, render

    from eagle3_pipeline.core.cluster import job_variables

    assert cfg.extract.parallel_groups == 4
    jobs = {}
    stages = [(f"extract-{g}", "extract", 25, "extract-group") for g in range(4)]
    stages += [("verify", "verify", None, "verify-stage"), ("train", "train", None, "train-stage"),
               ("evaluate", "evaluate", None, "evaluate-stage")]
    for name, stage, shards, flow in stages:
        jv = {"image": IMAGE, **job_variables(cfg, stage, shards), **(given or {})}
        template = TEMPLATE if jv["gpu_count"] else CPU_TEMPLATE
        jobs[name] = (jv, render(jv, template, flow))
    return jobs


def test_kimi_run_jobs_validate_and_request_what_the_config_implies(kimi):
    from eagle3_pipeline.core.cluster import stage_deadline_s

    jobs = kimi_run_jobs(kimi)
    assert len([n for n in jobs if n.startswith("extract-")]) == 4
    for name, (jv, job) in jobs.items():
        validate(job, f"the {name} Job")
        (c,) = job["spec"]["template"]["spec"]["containers"]
        gpus = c["resources"]["limits"].get("nvidia.com/gpu", 0)
        stage = name.split("-")[0]
        want = {"extract": kimi.extract.tensor_parallel_size, "train": kimi.train.world_size,
                "evaluate": kimi.evaluate.tensor_parallel_size, "verify": 0}[stage]
        assert gpus == want == (8 if stage != "verify" else 0), name
        assert c["resources"]["requests"].get("nvidia.com/gpu", 0) == gpus
        deadline = job["spec"]["activeDeadlineSeconds"]
        own = stage_deadline_s(kimi, stage, 25 if stage == "extract" else None)
        assert deadline == jv["deadline_seconds"] > own, name
        assert c["resources"]["requests"]["memory"] == jv["memory_request"]
        assert c["image"] == IMAGE
    # the config's own deadlines, each strictly inside its Job's
    assert jobs["extract-0"][1]["spec"]["activeDeadlineSeconds"] > kimi.extract.start_timeout_s + 25 * kimi.extract.shard_timeout_s
    assert jobs["train"][1]["spec"]["activeDeadlineSeconds"] > kimi.train.timeout_s
    assert jobs["evaluate"][1]["spec"]["activeDeadlineSeconds"] > kimi.evaluate.timeout_s
    assert jobs["verify"][1]["spec"]["activeDeadlineSeconds"] > kimi.verify.reference_timeout_s
    mem = jobs["verify"][1]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert int(mem.removesuffix("Gi")) > kimi.verify.reference_memory_gb


def test_kimi_run_jobs_carry_tolerations_service_account_and_pull_secrets_when_given(kimi):
    given = {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "eagle3", "effect": "NoSchedule"}],
             "service_account_name": "eagle3-runner", "image_pull_secrets": [{"name": "regcred"}],
             "cpu_limit": "96"}
    for name, (_, job) in kimi_run_jobs(kimi, given).items():
        validate(job, f"the {name} Job")
        pod = job["spec"]["template"]["spec"]
        assert pod["tolerations"] == given["tolerations"], name
        assert pod["serviceAccountName"] == "eagle3-runner" and pod["automountServiceAccountToken"] is False
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["containers"][0]["resources"]["limits"]["cpu"] == "96"


def test_a_broken_job_fails_validation(kimi):
    """The schemas are strict: a field in the wrong place (what the old template had: parallelism in the pod
    spec) or a wrong type is caught."""
    (_, job) = kimi_run_jobs(kimi)["train"]
    job["spec"]["template"]["spec"]["parallelism"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSIONS[0], strict=True)


def test_both_service_accounts_carry_the_registry_pull_secret():
    """A private registry's pull secret reaches the worker, every stage Job and the model-staging Job: each runs as
    a ServiceAccount that names it (Kubernetes adds an account's imagePullSecrets to its pods)."""
    objs = _objects()
    for sa in ("eagle3-worker", "eagle3-job"):
        assert objs[("ServiceAccount", sa)]["imagePullSecrets"] == [{"name": SAMPLE["IMAGE_PULL_SECRET"]}], sa
    staging = next(d for (k, n), d in objs.items() if k == "Job")
    assert staging["spec"]["template"]["spec"]["serviceAccountName"] == "eagle3-job"
    worker = objs[("Deployment", "eagle3-worker")]["spec"]["template"]["spec"]
    assert worker["serviceAccountName"] == "eagle3-worker"


def test_values_the_schema_accepts_but_kubernetes_refuses_are_named(kimi):
    """kubernetes-validate passes `memory: 512GiB`, `cpu: sixty-four` and an image name with spaces
    (structure only); cluster.value_problems names each, with where it is."""
    from eagle3_pipeline.core.cluster import value_problems

    (_, job) = kimi_run_jobs(kimi)["train"]
    c = job["spec"]["template"]["spec"]["containers"][0]
    c["resources"]["limits"]["memory"], c["resources"]["requests"]["cpu"] = "512GiB", "sixty-four"
    c["image"] = "my registry/eagle3 pipeline:latest"
    kubernetes_validate.validate(job, KUBERNETES_VERSIONS[0], strict=True)  # the schema accepts all three
    found = value_problems(job)
    assert any("limits.memory: '512GiB' is not a Kubernetes quantity" in p for p in found), found
    assert any("requests.cpu: 'sixty-four' is not a Kubernetes quantity" in p for p in found), found
    assert any("image: 'my registry/eagle3 pipeline:latest' is not an image reference" in p for p in found), found
    job["metadata"]["generateName"] = "Eagle3_Extract-"
    assert any("generateName: 'Eagle3_Extract-' is not a valid Kubernetes name" in p for p in value_problems(job))


# ------------------------------------------------------------------ infra/k8s/prefect.yaml


def test_kubernetes_deployments_name_the_pools_pools_sh_creates_and_flows_that_exist():
    spec = yaml.safe_load((K8S / "prefect.yaml").read_text())
    pools_sh = (K8S / "pools.sh").read_text()
    created = dict(re.findall(r"work-pool create (\S+) --type kubernetes --base-job-template \"\$placed/(\w+)\.json\"", pools_sh))
    assert created == {"eagle3-gpu": "gpu", "eagle3-cpu": "cpu"}
    # each from the repository's template with this cluster's placement (place.py)
    assert 'place.py" "$infra/k8s-$kind-job-template.json" "$kind" > "$placed/$kind.json"' in pools_sh
    created = {k: f"k8s-{v}-job-template.json" for k, v in created.items()}
    assert all((ROOT / "infra" / t).is_file() for t in created.values())
    assert "set-concurrency-limit eagle3-gpu" in pools_sh
    steps = [next(iter(s.values())) for s in spec["build"] + spec["push"]]
    assert [s["id"] for s in steps] == ["build-image", "push-image"]
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"pipeline-k8s", "extract-group-k8s", "verify-stage-k8s", "train-stage-k8s", "evaluate-stage-k8s"}
    process = {d["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    assert not set(deps) & process, "a name in both files would move a deployment between pools"
    pools = {"extract-group-k8s": "eagle3-gpu", "train-stage-k8s": "eagle3-gpu", "evaluate-stage-k8s": "eagle3-gpu",
             "verify-stage-k8s": "eagle3-cpu", "pipeline-k8s": "eagle3-cpu"}
    for name, d in deps.items():
        assert d["work_pool"]["name"] == pools[name] and d["work_pool"]["name"] in created
        assert d["work_pool"]["job_variables"]["image"] == "{{ push-image.stdout }}"  # pinned by digest
        path, func = d["entrypoint"].split(":")
        tree = ast.parse((ROOT / path).read_text())
        assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, d["entrypoint"]
    # the pipeline pod's targets are this file's deployments: <flow name>/<deployment name>
    env = deps["pipeline-k8s"]["work_pool"]["job_variables"]["env"]
    flows = {name: d["entrypoint"].split(":")[1].replace("_", "-") for name, d in deps.items()}
    assert env["EAGLE3_EXTRACT_GROUP_DEPLOYMENT"] == f"{flows['extract-group-k8s']}/extract-group-k8s"
    for stage in ("verify", "train", "evaluate"):
        assert env["EAGLE3_STAGE_DEPLOYMENT"].format(stage=stage) == f"{flows[stage + '-stage-k8s']}/{stage}-stage-k8s"
    assert deps["pipeline-k8s"]["parameters"]["output_dir"].startswith("/data/")  # on the store, not the pod


def test_pipeline_k8s_default_run_is_the_kimi_config_with_its_stages_as_deployments(monkeypatch):
    """What a run of pipeline-k8s with its default parameters resolves to, the way a worker's pod would (the
    image's working directory is this checkout's layout): the Kimi config, stages as deployments, 4 groups."""
    pytest.importorskip("prefect")
    from prefect.flows import load_flow_from_entrypoint

    from flows.config_param import resolve_config, switches

    (dep,) = [d for d in yaml.safe_load((K8S / "prefect.yaml").read_text())["deployments"] if d["name"] == "pipeline-k8s"]
    monkeypatch.chdir(ROOT)
    p = load_flow_from_entrypoint(dep["entrypoint"]).validate_parameters(dep["parameters"])
    cfg = resolve_config(p["config"], p["config_path"], switches(overrides=p["overrides"]))
    assert cfg.name == "kimi-k2.5-tp8" and cfg.gpu_stages == "deployments" and cfg.extract.parallel_groups == 4
    assert cfg.store.startswith("/data/") and cfg.target.model.startswith("/models/")  # the two volumes' mounts


# ------------------------------------------------------------------ issue 41: the pods a drain must not take

def test_gpu_jobs_are_not_disrupted_and_the_controller_reads_its_pods(kimi):
    """Every stage Job's pod: do-not-disrupt annotations (Karpenter, cluster-autoscaler), a termination grace
    for the shard in flight, a priority class that exists (priority.yaml); the pipeline's own pod runs as
    eagle3-controller with its token (pods get/list, jobs get/list/delete: flows/pods.py, nothing more), ranks
    above the GPU Jobs and is rescheduled, not crashed, by SIGTERM."""
    objs = _objects()
    classes = {name for (kind, name) in objs if kind == "PriorityClass"}
    assert classes == {"eagle3-gpu", "eagle3-control"}
    assert objs["PriorityClass", "eagle3-control"]["value"] > objs["PriorityClass", "eagle3-gpu"]["value"] > 0
    for name, (jv, job) in kimi_run_jobs(kimi).items():
        pod = job["spec"]["template"]
        ann = pod["metadata"]["annotations"]
        assert ann["karpenter.sh/do-not-disrupt"] == "true", name
        assert ann["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false", name
        assert pod["spec"]["priorityClassName"] in classes, name
        assert pod["spec"]["terminationGracePeriodSeconds"] >= 120, name
        assert pod["spec"]["automountServiceAccountToken"] is False, name  # stage pods: no Kubernetes API
    role = objs["Role", "eagle3-controller"]
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]} == {
        (("",), ("pods",)): {"get", "list"}, (("batch",), ("jobs",)): {"get", "list", "delete"}}
    (dep,) = [d for d in yaml.safe_load((K8S / "prefect.yaml").read_text())["deployments"] if d["name"] == "pipeline-k8s"]
    jv = dep["work_pool"]["job_variables"]
    assert jv["service_account_name"] == "eagle3-controller" and jv["automount_service_account_token"] is True
    assert jv["priority_class"] == "eagle3-control"
    assert jv["env"]["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"


def test_the_server_keeps_its_state():
    """prefect-server.yaml: the server pinned to the flows' Prefect, one replica on a PREFECT_HOME volume with the
    filesystem lease storage, PostgreSQL on a volume, basic auth and the database password from Secrets."""
    import re

    objs = _objects()
    server = objs["Deployment", "prefect-server"]
    (c,) = server["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"prefecthq/prefect:3\.7\.7-python3\.\d+", c["image"])
    assert server["spec"]["replicas"] == 1 and server["spec"]["strategy"]["type"] == "Recreate"
    env = {e["name"]: e for e in c["env"]}
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"]["value"].endswith("lease_storage.filesystem")
    home = env["PREFECT_HOME"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == home]
    vols = {v["name"]: v for v in server["spec"]["template"]["spec"]["volumes"]}
    assert ("PersistentVolumeClaim", vols[mount["name"]]["persistentVolumeClaim"]["claimName"]) in objs
    assert env["PREFECT_SERVER_API_AUTH_STRING"]["valueFrom"]["secretKeyRef"] == {"name": "prefect-auth",
                                                                                  "key": "auth-string"}
    assert "$(PREFECT_DB_PASSWORD)" in env["PREFECT_API_DATABASE_CONNECTION_URL"]["value"]
    pg = objs["StatefulSet", "eagle3-postgres"]
    (pc,) = pg["spec"]["template"]["spec"]["containers"]
    claim = pg["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objs and pc["image"].startswith("postgres:16")
    secrets = yaml.safe_load_all((K8S / "secrets.template.yaml").read_text())
    assert {"prefect-auth", "prefect-db"} <= {s["metadata"]["name"] for s in secrets}


@pytest.mark.parametrize("block", ["GKE", "EKS"])
def test_pools_place_pods_from_one_env_file(block, tmp_path):
    """pools.sh's templates take the node placement of cluster.env.example's platform blocks (GKE, EKS) as
    their defaults, and the rendered Job carries it; a value that is not JSON of the right type is refused."""
    pytest.importorskip("prefect_kubernetes")
    import json
    import os
    import subprocess
    import sys

    from tests.unit.test_k8s_job_template import render

    text = (K8S / "cluster.env.example").read_text()
    chosen = text.split(f"# --- {block}")[1].split("# ---")[0]
    env = {k: v.strip("'") for line in chosen.splitlines() if line.startswith("# EAGLE3_")
           for k, _, v in [line[2:].partition("=")]}
    env["EAGLE3_IMAGE_PULL_SECRET"] = "eagle3-registry"
    out = subprocess.run([sys.executable, str(K8S / "place.py"), str(ROOT / "infra" / "k8s-gpu-job-template.json"), "gpu"],
                         env={**os.environ, **env}, capture_output=True, text=True, check=True)
    (tmp_path / "gpu.json").write_text(out.stdout)
    job = render({"image": IMAGE}, tmp_path / "gpu.json", "extract-group")
    spec = job["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == json.loads(env["EAGLE3_GPU_NODE_SELECTOR"])
    assert spec["tolerations"] == json.loads(env["EAGLE3_GPU_TOLERATIONS"])
    assert spec["imagePullSecrets"] == [{"name": "eagle3-registry"}]
    bad = subprocess.run([sys.executable, str(K8S / "place.py"), str(ROOT / "infra" / "k8s-cpu-job-template.json"), "cpu"],
                         env={**os.environ, "EAGLE3_CPU_NODE_SELECTOR": "pool=cpu"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "EAGLE3_CPU_NODE_SELECTOR" in bad.stderr
