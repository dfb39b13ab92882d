"""The Kubernetes example (scripts/kubernetes_jobset.yaml) starts a run whose processes can join.

No cluster here: the test reads the manifest, builds each pod's environment
and command line the way the kubelet would (literal values, downward-API
annotations, `$(VAR)` expansion), and checks that the trainer's flags name
one coordinator, the right process count and every process id once. A typo
in a variable name or a process count edited in one place only fails here,
not hours later on a cluster.
"""

import importlib
import re

import pytest
import yaml

from sharding.distributed import DistributedOptions
from tests.helpers import REPO_ROOT

MANIFEST = REPO_ROOT / "scripts" / "kubernetes_jobset.yaml"
ANNOTATION_FIELD = re.compile(r"metadata\.annotations\['([^']+)'\]")
JOBSET_NAME_ANNOTATION = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def expand(text: str, variables: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (k8s.io/kubernetes third_party/forked/golang/expansion).

    `$(VAR)` becomes VAR's value when VAR is defined and stays as written
    otherwise; `$$` is an escaped `$` (so `$$(VAR)` gives `$(VAR)`); an
    unclosed `$(` or a `$` before any other character is kept.
    """
    out = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (close := text.find(")", i + 2)) != -1:
            name = text[i + 2 : close]
            out.append(variables.get(name, f"$({name})"))
            i = close + 1
        else:
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


def test_expand_follows_kubernetes_rules():
    variables = {"A": "x", "B": "$(A)"}
    assert expand("$(A)-$(A):1", variables) == "x-x:1"
    assert expand("$(MISSING)/$(A)", variables) == "$(MISSING)/x"
    assert expand("$$(A) $$ $$$(A)", variables) == "$(A) $ $x"
    assert expand("$(B)", variables) == "$(A)"  # one pass: a value is not expanded again
    assert expand("$(A", variables) == "$(A"
    assert expand("a$b$", variables) == "a$b$"


@pytest.fixture(scope="module")
def manifest():
    with open(MANIFEST) as f:
        return yaml.safe_load(f)


def workers(manifest):
    (replicated,) = manifest["spec"]["replicatedJobs"]
    return replicated


def job_spec(manifest):
    return workers(manifest)["template"]["spec"]


def pod_spec(manifest):
    return job_spec(manifest)["template"]["spec"]


def container(manifest):
    (train,) = pod_spec(manifest)["containers"]
    return train


def pod_environment(manifest, index: int) -> dict[str, str]:
    """The container's environment in pod `index`, built in list order as the kubelet does."""
    annotations = {JOBSET_NAME_ANNOTATION: manifest["metadata"]["name"], COMPLETION_INDEX_ANNOTATION: str(index)}
    env = {}
    for var in container(manifest)["env"]:
        if "valueFrom" in var:
            field = ANNOTATION_FIELD.fullmatch(var["valueFrom"]["fieldRef"]["fieldPath"])
            assert field and field.group(1) in annotations, f"{var['name']}: not an annotation JobSet sets"
            env[var["name"]] = annotations[field.group(1)]
        else:
            # The API rejects numbers here: env values are strings.
            assert isinstance(var["value"], str), f"{var['name']}: value must be a quoted string"
            env[var["name"]] = expand(var["value"], env)
    return env


def pod_argv(manifest, index: int) -> list[str]:
    """The command line pod `index` runs: `command` then `args`, expanded from the container's environment."""
    env = pod_environment(manifest, index)
    spec = container(manifest)
    return [expand(word, env) for word in spec.get("command", []) + spec.get("args", [])]


def parse_flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` flags after `python -m detector.train`, the only form the trainer's docs use."""
    assert argv[:3] == ["python", "-m", "detector.train"], argv
    flags = {}
    for word in argv[3:]:
        assert word.startswith("--") and "=" in word, f"{word!r} is not --name=value"
        name, value = word[2:].split("=", 1)
        assert name not in flags, f"--{name} given twice"
        assert "$(" not in value, f"--{name}={value}: a variable Kubernetes cannot expand"
        flags[name] = value
    return flags


def test_is_an_indexed_jobset_with_one_replica(manifest):
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert manifest["kind"] == "JobSet"
    # One Job: several would each number their pods from 0 and repeat process ids.
    assert workers(manifest)["replicas"] == 1
    spec = job_spec(manifest)
    assert spec["completionMode"] == "Indexed"
    env = {var["name"]: var.get("value") for var in container(manifest)["env"]}
    assert spec["parallelism"] == spec["completions"] == int(env["NUM_PROCESSES"])


def test_failures_restart_the_whole_run(manifest):
    """A lost process cannot be replaced alone: the Job fails at once and JobSet recreates every pod."""
    assert job_spec(manifest)["backoffLimit"] == 0
    assert pod_spec(manifest)["restartPolicy"] == "Never"
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] >= 1


def test_grace_period_leaves_time_for_the_preemption_checkpoint(manifest):
    assert pod_spec(manifest)["terminationGracePeriodSeconds"] >= 120


def test_each_pod_gets_eight_gpus_and_a_memory_backed_dev_shm(manifest):
    assert int(container(manifest)["resources"]["limits"]["nvidia.com/gpu"]) == 8
    volumes = {v["name"]: v for v in pod_spec(manifest)["volumes"]}
    (shm,) = [m for m in container(manifest)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


def test_workdir_is_on_the_shared_claim(manifest):
    """Every pod writes its part of each checkpoint to --workdir, and a restarted pod reads it back."""
    volumes = {v["name"]: v for v in pod_spec(manifest)["volumes"]}
    workdir = parse_flags(pod_argv(manifest, 0))["workdir"]
    mounts = [
        m
        for m in container(manifest)["volumeMounts"]
        if workdir.startswith(m["mountPath"].rstrip("/") + "/") and not m.get("readOnly", False)
    ]
    assert mounts, f"--workdir={workdir} is under no writable mount"
    innermost = max(mounts, key=lambda m: len(m["mountPath"]))
    assert "persistentVolumeClaim" in volumes[innermost["name"]]


def test_config_and_its_overrides_exist(manifest):
    flags = parse_flags(pod_argv(manifest, 0))
    path = flags["config"]
    # Relative to the container's workingDir, the repository in the image.
    assert not path.startswith("/") and (REPO_ROOT / path).is_file(), path
    config = importlib.import_module(path.removesuffix(".py").replace("/", ".")).get_config()
    for name in flags:
        if name.startswith("config."):
            node = config
            for part in name.split(".")[1:]:
                assert part in node, f"--{name}: the config has no such field"
                node = node[part]


def test_every_pod_joins_the_same_run_with_its_own_process_id(manifest):
    """Simulates each pod: all name pod 0's DNS name as coordinator and the ids cover 0..N-1 once."""
    name = manifest["metadata"]["name"]
    assert manifest["spec"]["network"]["enableDNSHostnames"] is True
    subdomain = manifest["spec"]["network"].get("subdomain", name)
    # Pod I of job J of a replicated job is `<jobset>-<replicated job>-J-I`, under the headless service.
    coordinator_host = f"{name}-{workers(manifest)['name']}-0-0.{subdomain}"
    ports = {p["containerPort"] for p in container(manifest)["ports"]}
    num_pods = job_spec(manifest)["parallelism"]

    options = []
    for index in range(num_pods):
        flags = parse_flags(pod_argv(manifest, index))
        pod_options = DistributedOptions(
            coordinator_address=flags["coordinator_address"],
            num_processes=int(flags["num_processes"]),
            process_id=int(flags["process_id"]),
        )
        assert pod_options.explicit()
        host, port = pod_options.coordinator_address.rsplit(":", 1)
        assert host == coordinator_host
        assert int(port) in ports, f"coordinator port {port} is not a containerPort"
        assert pod_options.num_processes == num_pods
        assert pod_options.process_id == index
        options.append(pod_options)

    assert len({o.coordinator_address for o in options}) == 1
    assert sorted(o.process_id for o in options) == list(range(num_pods))
