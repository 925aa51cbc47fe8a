"""``bundle inspect``: a bundle's report -- the manifest summary, the weights footprint, each
module's arity and signature check -- and the verdict whether a worker can serve it.

Nothing is compiled: inspection reads headers and module signatures only, so it runs anywhere
(jax is imported for the signature reader, not for a device).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from kserve_trio.core.bundles import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    Manifest,
    TensorSpec,
    discover_modules,
    is_bundle_dir,
    sidecar_path,
    validate_manifest,
)
from kserve_trio.core.errors import BundleError
from kserve_trio.export.arity import bundle_arity_report
from kserve_trio.runtime import check_module_signature, entry_signature, read_weights_index


def _shape(spec: TensorSpec) -> str:
    return "[" + ",".join(str(d) for d in spec.wire_shape()) + "]"


def _tensor_line(spec: TensorSpec) -> str:
    batch = f" batch axis {spec.batch_axis}" if spec.batch_axis is not None else ""
    return f"{spec.name} {spec.dtype.token}{_shape(spec)}{batch}"


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def inspect_bundle(d: Path, *, out: TextIO) -> bool:
    """Print one bundle's report; returns whether it is servable."""
    print(f"bundle {d.name} ({d})", file=out)
    problems: list[str] = []
    try:
        m: Manifest = validate_manifest(d)
    except BundleError as exc:
        print(f"  UNSERVABLE: {exc}", file=out)
        return False
    print(f"  format {m.format_version}, kind {m.kind}", file=out)
    if m.description:
        print(f"  description: {m.description}", file=out)
    for label, specs in (
        ("executable inputs", m.executable_inputs),
        ("executable outputs", m.executable_outputs),
        ("client inputs", m.client_inputs),
        ("client outputs", m.client_outputs),
    ):
        if specs is not None and (specs or label.startswith("executable")):
            print(f"  {label}: " + "; ".join(_tensor_line(s) for s in specs), file=out)
    if m.is_meta:
        print(f"  meta calls: {', '.join(m.meta_calls) or '(none)'}", file=out)
        print("  verdict: servable (meta model: nothing to compile)", file=out)
        return True
    sizes = m.batching.compiled_batch_sizes
    print(f"  compiled batch sizes: {', '.join(map(str, sizes)) or '(none)'}", file=out)
    if m.input_shapes:
        shown = ", ".join(f"v{i} {dict(e)}" for i, e in enumerate(m.input_shapes))
        print(f"  shape variants: {shown}", file=out)

    index = None
    try:
        index = read_weights_index(d / WEIGHTS_FILE, bundle=m.name)
        print(
            f"  weights: {len(index.entries)} tensor(s), {index.nbytes} bytes "
            f"({_human(index.nbytes)}) in argument order",
            file=out,
        )
    except BundleError as exc:
        problems.append(str(exc))
        print(f"  weights: ERROR {exc}", file=out)

    report = bundle_arity_report(d)
    print(
        f"  modules: each must take {report.expected} argument(s) "
        f"({report.n_inputs} input(s) + {report.n_weights} weight(s))",
        file=out,
    )
    for mod in report.modules:
        sidecar = sidecar_path(d / mod.module_file).is_file()
        if mod.entry_args is None:
            state = f"UNREADABLE ({mod.error})"
        else:
            state = f"{mod.entry_args} args " + ("ok" if mod.servable else "MISMATCH")
        extra = " (+ .jaxexport)" if sidecar else ""
        print(f"    {mod.module_file}: {state}{extra}", file=out)
        if not mod.servable:
            problems.append(f"{mod.module_file}: arity {mod.entry_args} != {report.expected}")

    if index is not None and report.servable:
        try:
            modules = discover_modules(d, m)
            for variant, by_key in modules.items():
                for key, path in by_key.items():
                    sig = entry_signature(path.read_bytes())
                    check_module_signature(
                        sig,
                        manifest=m,
                        weights=index,
                        module=path.name,
                        variant=variant,
                        batch_key=key,
                        where=f"bundle '{m.name}'",
                    )
        except (BundleError, ValueError) as exc:
            problems.append(str(exc))
    if problems:
        print("  verdict: UNSERVABLE", file=out)
        for p in problems:
            print(f"    - {p}", file=out)
        return False
    print("  verdict: servable", file=out)
    return True


def inspect_command(target: Path, *, out: TextIO) -> int:
    """Inspect a bundle, or every bundle directly under a repository; 1 if any is unservable."""
    if not target.is_dir():
        print(f"error: {target} is not a directory", file=sys.stderr)
        return 2
    if is_bundle_dir(target):
        bundles = [target]
    else:
        bundles = sorted(p for p in target.iterdir() if is_bundle_dir(p))
        if not bundles:
            print(f"error: {target} holds no bundle (no {MANIFEST_FILE})", file=sys.stderr)
            return 2
    ok = True
    for i, b in enumerate(bundles):
        if i:
            print(file=out)
        ok = inspect_bundle(b, out=out) and ok
    return 0 if ok else 1


__all__ = ["inspect_bundle", "inspect_command"]
