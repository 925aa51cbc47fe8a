"""Schema and PromQL checks, run by the deployment tests in ``.venv-deploy`` (a subprocess).

Reads ``{"objects": [...], "promql": [...], "k8s_version": "1.32.0"}`` as JSON on stdin and
prints ``{"schema": [[index, message], ...], "promql": [{"names": [...], "error": ...}]}``:

- built-in kinds: ``kubernetes_validate`` in strict mode (unknown fields are errors);
- ``serving.kserve.io`` kinds: the kserve SDK's generated models (``kserve.models``, with
  ``kubernetes.client.models`` for the core types they embed), walked strictly: every key must
  be an attribute of the model, every value of the declared type, and each model is built with
  client-side validation on (required fields, enums);
- PromQL: ``promql_parser`` parses each expression; ``names`` are its selectors' metric names
  (``None`` for a selector without one) and ``selectors`` each selector's name with the label
  names its matchers filter on.

Standard library plus those three packages only: it never imports kserve_trio.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

# The generators spell containers both ways: list[X] / dict(str, X) and List[X] / Dict[str, X].
_LIST = re.compile(r"^[Ll]ist\[(.+)\]$")
_DICT = re.compile(r"^(?:dict\(|Dict\[)([^,]+), (.+)[)\]]$")
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "object": (object,),
    "datetime": (str,),
    "date": (str,),
}


def _model_class(name: str) -> Any:
    import kserve.models
    import kubernetes.client.models

    for module in (kserve.models, kubernetes.client.models):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(f"no model class {name}")


def strict_model(value: Any, klass: str, path: str) -> Any:
    """``value`` as an instance of the generated type ``klass``; ``ValueError`` naming the path
    of the first key or value the type does not accept."""
    m = _LIST.match(klass)
    if m:
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list for {klass}")
        return [strict_model(v, m.group(1), f"{path}[{i}]") for i, v in enumerate(value)]
    m = _DICT.match(klass)
    if m:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping for {klass}")
        return {k: strict_model(v, m.group(2), f"{path}.{k}") for k, v in value.items()}
    if klass in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[klass]) and not (
            klass in ("int", "float") and isinstance(value, bool)
        )
        if not ok:
            raise ValueError(f"{path}: expected {klass}, got {type(value).__name__} {value!r}")
        return value
    cls = _model_class(klass)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a mapping for {klass}")
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    kwargs = {}
    for key, item in value.items():
        if key not in by_json:
            raise ValueError(f"{path}: unknown field {key!r} for {klass}")
        attr = by_json[key]
        kwargs[attr] = strict_model(item, cls.openapi_types[attr], f"{path}.{key}")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


_KSERVE_KINDS = {
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}


def check_object(obj: dict, k8s_version: str) -> str | None:
    """The first schema error of ``obj``, or ``None``."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in _KSERVE_KINDS:
        try:
            strict_model(obj, _KSERVE_KINDS[key], obj["kind"])
        except (ValueError, LookupError) as exc:
            return str(exc)
        return None
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{obj.get('kind')} {where}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError:
        return f"no schema for {key[0]} {key[1]} in Kubernetes {k8s_version}"
    return None


def promql_names(expr: str) -> dict:
    import promql_parser

    try:
        tree = promql_parser.parse(expr)
    except ValueError as exc:
        return {"names": [], "selectors": [], "error": str(exc)}
    selectors: list[list[Any]] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            labels = sorted({m.name for m in node.matchers.matchers} - {"__name__"})
            selectors.append([node.name, labels])
        return True

    promql_parser.walk(tree, visit)
    return {"names": [s[0] for s in selectors], "selectors": selectors, "error": None}


def main() -> int:
    request = json.load(sys.stdin)
    version = request.get("k8s_version", "1.32.0")
    schema = []
    for i, obj in enumerate(request.get("objects", [])):
        error = check_object(obj, version)
        if error is not None:
            schema.append([i, error])
    promql = [promql_names(e) for e in request.get("promql", [])]
    json.dump({"schema": schema, "promql": promql}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
