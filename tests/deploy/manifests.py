"""Reading the deployment assets the way their consumers do: Dockerfiles (instructions, exec-form
argv, ENV, COPY), BuildKit ignore files, YAML manifests, a container's command line and
environment, and the files its volumes put at each path.

Pure functions over text and parsed objects (plus reading files under ``deploy/``), so each
consistency test states its rule in a line or two.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CONTAINER = DEPLOY / "container"
DOCKERFILES = {"cpu": CONTAINER / "cpu.Dockerfile", "cuda": CONTAINER / "cuda.Dockerfile"}

FOREIGN_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PIP_NO_CACHE_DIR",
        "PIP_DISABLE_PIP_VERSION_CHECK",
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
    }
)
"""Variables the recipes set that belong to Python, pip, the shell or the NVIDIA container
toolkit rather than to kserve_trio."""


# ---------------------------------------------------------------------------------------------
# Dockerfiles


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int

    def exec_form(self) -> list[str]:
        """The JSON (exec) form's argv; anything else is an error (shell form is not allowed
        for the commands the tests check, since its argv depends on a shell)."""
        value = json.loads(self.args)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.keyword} is not in exec form: {self.args}")
        return value


@dataclass
class Dockerfile:
    path: Path
    instructions: list[Instruction]
    stages: list[str] = field(default_factory=list)

    def final(self, keyword: str) -> list[Instruction]:
        last = len(self.stages) - 1
        return [i for i in self.instructions if i.keyword == keyword and i.stage == last]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """The final stage's ENV, as the image's processes see it (``$VAR`` left as written)."""
        out: dict[str, str] = {}
        for ins in self.final("ENV"):
            for word in shlex.split(ins.args):
                key, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"ENV without '=' (legacy form) in {self.path}: {ins.args}")
                out[key] = value
        return out

    def one(self, keyword: str) -> Instruction:
        found = self.final(keyword)
        if len(found) != 1:
            raise ValueError(f"{self.path} has {len(found)} {keyword} instructions in its image")
        return found[0]

    def entry_argv(self, args: Sequence[str] | None = None) -> list[str]:
        """ENTRYPOINT + CMD, or ENTRYPOINT + ``args`` (what Kubernetes' ``args:`` replaces)."""
        entry = self.one("ENTRYPOINT").exec_form()
        return entry + (list(args) if args is not None else self.one("CMD").exec_form())

    def healthcheck_argv(self) -> list[str]:
        words = self.one("HEALTHCHECK").args.split("CMD", 1)
        return json.loads(words[1])

    def copies(self, stage: int | None = None) -> list[tuple[list[str], str, str | None]]:
        """The COPYs (of stage ``stage``, else the final one's) as (sources, destination,
        --from stage or None)."""
        stage = len(self.stages) - 1 if stage is None else stage
        out = []
        for ins in self.all("COPY"):
            if ins.stage != stage:
                continue
            words = shlex.split(ins.args)
            source_stage = None
            plain = []
            for w in words:
                if w.startswith("--from="):
                    source_stage = w.split("=", 1)[1]
                elif not w.startswith("--"):
                    plain.append(w)
            out.append((plain[:-1], plain[-1], source_stage))
        return out

    def workdir(self, stage: int) -> str:
        dirs = [i.args for i in self.instructions if i.keyword == "WORKDIR" and i.stage == stage]
        return dirs[-1] if dirs else "/"


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions with line continuations joined and comments dropped; stages numbered."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        raise ValueError(f"{path}: dangling line continuation")
    df = Dockerfile(path, [])
    stage = -1
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
            words = args.split()
            df.stages.append(words[2] if len(words) >= 3 and words[1].upper() == "AS" else "")
        df.instructions.append(Instruction(keyword, args.strip(), stage))
    return df


def dockerfile_for_image(image: str) -> Path:
    """``kserve-trio:<version>-cpu`` -> cpu.Dockerfile, ``...-cuda`` -> cuda.Dockerfile."""
    name, _, tag = image.rpartition(":")
    if not name.endswith("kserve-trio"):
        raise ValueError(f"not a kserve-trio image: {image}")
    variant = tag.rsplit("-", 1)[-1]
    return DOCKERFILES[variant]


# ---------------------------------------------------------------------------------------------
# BuildKit ignore files


def ignore_patterns(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def _matches(rel: str, pattern: str) -> bool:
    pattern = pattern.rstrip("/")
    if pattern.startswith("**/"):
        tail = pattern[3:]
        parts = rel.split("/")
        return any(fnmatch.fnmatchcase("/".join(parts[i:]), tail) for i in range(len(parts))) or (
            any(fnmatch.fnmatchcase(p, tail) for p in parts)
        )
    parts = rel.split("/")
    # A pattern matches a path or any of its parent directories.
    return any(fnmatch.fnmatchcase("/".join(parts[: i + 1]), pattern) for i in range(len(parts)))


def is_ignored(rel: str, patterns: Sequence[str]) -> bool:
    """Docker's rule: the last pattern that matches decides; ``!`` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        if _matches(rel, pattern[1:] if negate else pattern):
            ignored = not negate
    return ignored


def tracked_files(under: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--", under], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if line]


# ---------------------------------------------------------------------------------------------
# YAML manifests


def load_yaml_docs(text: str) -> list[Any]:
    return [d for d in YAML(typ="safe").load_all(text) if d is not None]


def load_yaml_file(path: Path) -> list[Any]:
    return load_yaml_docs(path.read_text())


def find(objects: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> list[dict]:
    return [
        o
        for o in objects
        if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)
    ]


def pod_spec(obj: Mapping[str, Any]) -> dict:
    """The pod spec of a workload (its template's), or a ServingRuntime's spec."""
    if obj["kind"] in ("ServingRuntime", "ClusterServingRuntime"):
        return obj["spec"]
    return obj["spec"]["template"]["spec"]


def pod_labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(obj["spec"]["template"]["metadata"].get("labels") or {})


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for item in container.get("env") or []:
        if "value" not in item:
            raise ValueError(f"env {item['name']} has no literal value")
        out[item["name"]] = str(item["value"])
    return out


def port_numbers(container: Mapping[str, Any]) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in container["ports"]}


def resolve_port(container: Mapping[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number, or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    return port_numbers(container)[port]


def mounted_files(
    spec: Mapping[str, Any], container: Mapping[str, Any], objects: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """Container path -> text of every file its ConfigMap volumes put there."""
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    configmaps = {o["metadata"]["name"]: o for o in find(objects, "ConfigMap")}
    out = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        if "configMap" not in volume:
            continue
        data = configmaps[volume["configMap"]["name"]]["data"]
        for key, text in data.items():
            out[f"{mount['mountPath'].rstrip('/')}/{key}"] = text
    return out


def mount_for(container: Mapping[str, Any], path: str) -> dict | None:
    """The volume mount a container path lives under (the deepest one), if any."""
    best = None
    for mount in container.get("volumeMounts") or []:
        root = mount["mountPath"].rstrip("/")
        if path == root or path.startswith(root + "/"):
            if best is None or len(root) > len(best["mountPath"].rstrip("/")):
                best = mount
    return best
