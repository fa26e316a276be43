"""The Kubernetes recipe (examples/kubernetes/) checked without a cluster: every manifest is valid
against Kubernetes' own schemas (kubernetes-validate bundles them: strict, so a misspelt field is
an error), and every `recover` command in it parses with recover's own command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from recover.cli import build_parser

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (a dev dependency) is not installed"
)
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "examples" / "kubernetes").glob("*.yaml"))
# The oldest Kubernetes the recipe claims (Indexed Jobs with podFailurePolicy are GA from 1.31).
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())


def documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return pod.get("containers", [])


def test_the_recipe_has_a_coordinator_service_and_agents():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents()}
    assert ("Service", "recover-coordinator") in kinds
    assert ("Deployment", "recover-coordinator") in kinds
    assert ("Job", "recover-agents") in kinds


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    for doc in documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{doc['kind']} {doc['metadata']['name']}: {e.message}") from e


def test_a_misspelt_field_is_caught_by_the_check():
    """The strict check would fail a manifest that Kubernetes rejects (so the test above can)."""
    (doc,) = [d for d in documents() if d["kind"] == "Job"]
    doc["spec"]["completionsMode"] = "Indexed"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[0], strict=True)


def test_every_recover_command_in_the_manifests_parses():
    parser = build_parser()
    seen = []
    for doc in documents():
        for c in containers(doc):
            command = c.get("command", [])
            if command[:1] == ["recover"]:
                args = parser.parse_args(command[1:])
                seen.append(args.command)
    assert sorted(seen) == ["agent", "coordinator"]
    (job,) = [d for d in documents() if d["kind"] == "Job"]
    (agent,) = containers(job)
    rules = job["spec"]["podFailurePolicy"]["rules"]  # (they name the agent's container)
    assert {r["onExitCodes"]["containerName"] for r in rules if "onExitCodes" in r} == {
        agent["name"]
    }
    # the agent pods: one per node, spread; the standby is the pod beyond the replicas' count
    assert job["spec"]["completions"] == job["spec"]["parallelism"]
    (deployment,) = [d for d in documents() if d["kind"] == "Deployment"]
    replicas = next(a for a in containers(deployment)[0]["command"] if a.startswith("--replicas="))
    assert job["spec"]["completions"] > int(replicas.split("=")[1])
