"""Tests for ``kserve_trio.core.bundles.manifest`` and ``kserve_trio.core.bundles.bundle``: parsing, the bundle
validation rules (each provoked with its exact message), the row-major reversal, shape variants,
module discovery, the bundle file names and the derived batch questions."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest

from kserve_trio.core.bundles.bundle import (
    bundle_signature_files,
    discover_modules,
    load_manifest,
    validate_manifest,
)
from kserve_trio.core.bundles.manifest import (
    BatchingSpec,
    Dim,
    DimKind,
    Manifest,
    VariableAxis,
    executable_batch_spec,
    is_meta,
    parse_manifest,
    parse_tensor_spec,
    request_rows,
    wire_batch_spec,
)
from kserve_trio.core.errors import BundleError, InvalidArgument, ManifestError
from kserve_trio.core.tensors.dtypes import DType

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
P = "manifest 'm' (<manifest>): "


def tensor(name: str, shape: str, dims: dict[str, int] | None = None, dtype: str = "f32") -> dict:
    return {"name": name, "dtype": dtype, "shape": shape, "dims": dict(dims or {})}


def base(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "format_version": "2.0",
        "name": "resnet",
        "executable_inputs": [tensor("x", "whcn", {"w": 5, "h": 4, "c": 3})],
        "executable_outputs": [tensor("y", "kn", {"k": 10})],
        "batching": {"compiled_batch_sizes": [1, 2, 4]},
    }
    raw.update(over)
    return raw


def meta_raw(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "format_version": "2",
        "kind": "meta",
        "meta": {"calls": ["a", "b"]},
        "client_inputs": [tensor("q", "cn", {"c": 2})],
        "client_outputs": [tensor("r", "n")],
    }
    raw.update(over)
    return raw


def parse(raw: dict[str, Any], name: str = "m") -> Manifest:
    return parse_manifest(raw, name)


def manifest_error(raw: Any, name: str = "m") -> str:
    with pytest.raises(ManifestError) as ei:
        parse_manifest(raw, name)
    return str(ei.value)


# ----------------------------------------------------------------------------- fixture + basics


def test_upstream_scale4_fixture_parses() -> None:
    m = load_manifest(FIXTURES / "scale4" / "manifest.yaml")
    assert m.format_version == "2.0"
    assert m.name == "scale4"
    assert m.kind == "model" and not m.is_meta and not is_meta(m)
    assert [t.name for t in m.executable_inputs] == ["x"]
    x = m.executable_inputs[0]
    assert x.dtype is DType.F32
    assert x.dims == (Dim(DimKind.FIXED, 4, "c"),)
    assert x.batch_axis is None and x.rank == 1 and x.wire_shape() == [4]
    assert m.executable_outputs[0].name == "y"
    assert m.executable_outputs[0].wire_shape() == [4]
    assert m.batching == BatchingSpec((1,))
    assert m.client_inputs is None and m.wire_inputs == m.executable_inputs
    assert m.wire_outputs == m.executable_outputs
    assert m.input_batch_dim is None
    assert m.input_shapes == () and m.variant_keys == () and m.variable_axes == ()
    assert m.variant_index({"x": [4]}) is None
    assert wire_batch_spec(m) is None
    assert request_rows(m, {"x": [4]}) == 1


def test_scale4_bundle_validates_with_a_single_model_mlir(tmp_path: Path) -> None:
    d = tmp_path / "scale4"
    d.mkdir()
    shutil.copy(FIXTURES / "scale4" / "manifest.yaml", d / "manifest.yaml")
    (d / "model.mlir").write_bytes(b"\x00")
    (d / "weights.safetensors").write_bytes(b"\x00")
    m = validate_manifest(d)
    assert m.name == "scale4"
    assert discover_modules(d, m) == {None: {0: d / "model.mlir"}}


def test_whcn_reverses_to_row_major_batch_axis_zero() -> None:
    m = parse(base())
    x = m.executable_inputs[0]
    assert x.letters == "whcn" and x.row_letters == "nchw"
    assert x.dims == (
        Dim(DimKind.BATCH, 0, "n"),
        Dim(DimKind.FIXED, 3, "c"),
        Dim(DimKind.FIXED, 4, "h"),
        Dim(DimKind.FIXED, 5, "w"),
    )
    assert x.batch_axis == 0
    assert x.wire_shape() == [-1, 3, 4, 5]
    assert x.wire_shape(rows=8) == [8, 3, 4, 5]
    assert m.input_batch_dim == 0
    assert m.executable_outputs[0].wire_shape() == [-1, 10]


def test_nchw_letters_put_the_batch_axis_last_in_row_major() -> None:
    m = parse(base(executable_inputs=[tensor("x", "nchw", {"c": 3, "h": 224, "w": 225})]))
    x = m.executable_inputs[0]
    assert x.wire_shape() == [225, 224, 3, -1]
    assert x.batch_axis == 3
    assert m.input_batch_dim == 3


def test_b_marker_and_variable_axis() -> None:
    spec = parse_tensor_spec(tensor("img", "bd", {"d": -1}, dtype="u8"))
    assert spec.dims == (Dim(DimKind.VARIABLE, 0, "d"), Dim(DimKind.BATCH, 0, "b"))
    assert spec.batch_axis == 1
    assert spec.wire_shape() == [-1, -1]
    assert spec.dtype is DType.U8


def test_uppercase_n_and_b_are_ordinary_letters() -> None:
    spec = parse_tensor_spec(tensor("x", "NB", {"N": 2, "B": 3}))
    assert spec.batch_axis is None
    assert spec.wire_shape() == [3, 2]


def test_scalar_tensor_has_rank_zero() -> None:
    spec = parse_tensor_spec(tensor("s", ""))
    assert spec.rank == 0 and spec.wire_shape() == [] and spec.batch_axis is None


def test_inputs_may_place_the_batch_axis_at_different_positions() -> None:
    m = parse(
        base(
            executable_inputs=[tensor("x", "nc", {"c": 3}), tensor("y", "cn", {"c": 3})],
            executable_outputs=[tensor("z", "n")],
        )
    )
    assert m.executable_inputs[0].batch_axis == 1  # manifest nc = wire (c, n)
    assert m.executable_inputs[1].batch_axis == 0  # manifest cn = wire (n, c)
    assert m.input_batch_dim == 1


def test_serving_name_overrides_the_manifest_name_and_optional_fields_default() -> None:
    raw = base(description="a net", provenance={"git_commit": "abc"})
    m = parse(raw, "served")
    assert m.name == "served"
    assert m.description == "a net"
    assert m.provenance == {"git_commit": "abc"}
    del raw["name"]
    assert parse(raw).name == "m"


def test_non_mapping_provenance_is_replaced_by_empty() -> None:
    assert parse(base(provenance=[1, 2])).provenance == {}


def test_null_optional_keys_count_as_absent() -> None:
    m = parse(base(client_inputs=None, description=None, kind=None, batching=None))
    assert m.client_inputs is None and m.description == "" and m.kind == "model"
    assert m.batching == BatchingSpec(())


@pytest.mark.parametrize("fv, stored", [("2.0", "2.0"), ("2", "2"), (2.0, "2.0"), (2, "2")])
def test_format_version_accepted_forms(fv: Any, stored: str) -> None:
    assert parse(base(format_version=fv)).format_version == stored


@pytest.mark.parametrize("fv, shown", [("3", "3"), (2.1, "2.1"), ("2.00", "2.00"), (True, "True")])
def test_format_version_rejected(fv: Any, shown: str) -> None:
    assert manifest_error(base(format_version=fv)) == (
        P + f"unsupported format_version '{shown}'; supported: 2.0, 2"
    )


def test_yaml_float_format_version_and_letters_y_n_stay_strings(tmp_path: Path) -> None:
    d = tmp_path / "yn"
    d.mkdir()
    (d / "manifest.yaml").write_text(
        "format_version: 2.0\n"
        "executable_inputs:\n"
        "  - {name: x, dtype: f32, shape: yn, dims: {y: 7}}\n"
        "executable_outputs:\n"
        "  - {name: o, dtype: f32, shape: n}\n"
    )
    m = load_manifest(d / "manifest.yaml")
    assert m.format_version == "2.0" and m.name == "yn"
    assert m.executable_inputs[0].wire_shape() == [-1, 7]


# ----------------------------------------------------------------------------- parse errors


def with_input(entry: Any) -> dict[str, Any]:
    return base(executable_inputs=[entry])


TENSOR_ERRORS = [
    ("not a mapping", ["x"], "executable_inputs[0] tensor entry must be a mapping (got list)"),
    (
        "no name",
        {"dtype": "f32", "shape": "n"},
        "executable_inputs[0] tensor entry missing string 'name'",
    ),
    ("empty name", tensor("", "n"), "executable_inputs[0] tensor entry missing string 'name'"),
    (
        "no dtype",
        {"name": "x", "shape": "n"},
        "executable_inputs tensor 'x' missing string 'dtype'",
    ),
    (
        "unknown dtype",
        tensor("x", "n", dtype="f33"),
        "executable_inputs tensor 'x' has unknown dtype 'f33'",
    ),
    (
        "no shape",
        {"name": "x", "dtype": "f32"},
        "executable_inputs tensor 'x' missing string 'shape' (einsum letters)",
    ),
    (
        "shape not str",
        {"name": "x", "dtype": "f32", "shape": 3},
        "executable_inputs tensor 'x' missing string 'shape' (einsum letters)",
    ),
    (
        "dims not map",
        {"name": "x", "dtype": "f32", "shape": "n", "dims": [1]},
        "executable_inputs tensor 'x' has 'dims' that is not a mapping (got list)",
    ),
    (
        "non-letter",
        tensor("x", "c1", {"c": 3}),
        "executable_inputs tensor 'x' shape 'c1' contains non-letter character '1'",
    ),
    (
        "non-ascii",
        tensor("x", "cé", {"c": 3}),
        "executable_inputs tensor 'x' shape 'cé' contains non-letter character 'é'",
    ),
    (
        "duplicate letters",
        tensor("x", "cc", {"c": 3}),
        "executable_inputs tensor 'x' shape 'cc' has duplicate axis letters",
    ),
    (
        "two n",
        tensor("x", "nn"),
        "executable_inputs tensor 'x' shape 'nn' has duplicate axis letters",
    ),
    (
        "n and b",
        tensor("x", "nb"),
        "executable_inputs tensor 'x' has more than one batch axis ('n'/'b') in shape 'nb'",
    ),
    (
        "dims key long",
        tensor("x", "cn", {"cc": 3}),
        "executable_inputs tensor 'x' dims key 'cc' is not a single ASCII letter",
    ),
    (
        "dims key int",
        tensor("x", "cn", {1: 3}),
        "executable_inputs tensor 'x' dims key '1' is not a single ASCII letter",
    ),
    (
        "dims key n",
        tensor("x", "cn", {"c": 3, "n": 4}),
        "executable_inputs tensor 'x' dims key 'n' is reserved for the batch axis",
    ),
    (
        "dims key b",
        tensor("x", "cb", {"b": 4}),
        "executable_inputs tensor 'x' dims key 'b' is reserved for the batch axis",
    ),
    (
        "dims value str",
        tensor("x", "cn", {"c": "3"}),
        "executable_inputs tensor 'x' dims['c'] is not an integer (got str)",
    ),
    (
        "dims value float",
        tensor("x", "cn", {"c": 3.0}),
        "executable_inputs tensor 'x' dims['c'] is not an integer (got float)",
    ),
    (
        "dims value bool",
        tensor("x", "cn", {"c": True}),
        "executable_inputs tensor 'x' dims['c'] is not an integer (got bool)",
    ),
    (
        "dims value zero",
        tensor("x", "cn", {"c": 0}),
        "executable_inputs tensor 'x' dims['c']=0; must be > 0 or -1",
    ),
    (
        "dims value -2",
        tensor("x", "cn", {"c": -2}),
        "executable_inputs tensor 'x' dims['c']=-2; must be > 0 or -1",
    ),
    (
        "orphan dims",
        tensor("x", "cn", {"c": 3, "k": 7, "a": 1}),
        "executable_inputs tensor 'x' has dims entries not in shape: ['a', 'k']",
    ),
    (
        "missing dims",
        tensor("x", "ckn", {"c": 3}),
        "executable_inputs tensor 'x' shape uses 'k' but dims has no entry for it",
    ),
]


@pytest.mark.parametrize(
    "entry, rule", [t[1:] for t in TENSOR_ERRORS], ids=[t[0] for t in TENSOR_ERRORS]
)
def test_tensor_entry_rules(entry: Any, rule: str) -> None:
    assert manifest_error(with_input(entry)) == P + rule


def test_tensor_rules_name_the_section() -> None:
    raw = base(client_outputs=[tensor("z", "q")])
    assert (
        manifest_error(raw)
        == P + "client_outputs tensor 'z' shape uses 'q' but dims has no entry for it"
    )


def test_parse_tensor_spec_errors_are_manifest_errors() -> None:
    with pytest.raises(ManifestError) as ei:
        parse_tensor_spec(tensor("x", "c"), section="client_inputs")
    assert str(ei.value) == (
        "tensor spec: client_inputs tensor 'x' shape uses 'c' but dims has no entry for it"
    )


def without(key: str, raw: dict[str, Any] | None = None) -> dict[str, Any]:
    raw = copy.deepcopy(raw if raw is not None else base())
    del raw[key]
    return raw


MANIFEST_RULES = [
    ("not a mapping", ["x"], "manifest is not a mapping (got list)"),
    ("name not str", base(name=3), "manifest field 'name' must be a string"),
    ("no format_version", without("format_version"), "missing 'format_version'"),
    (
        "description not str",
        base(description=["a"]),
        "field 'description' must be a string (got list)",
    ),
    ("kind not str", base(kind=1), "field 'kind' must be a string"),
    ("kind unknown", base(kind="ensemble"), "unsupported kind 'ensemble'; supported: model, meta"),
    ("no exec inputs", without("executable_inputs"), "missing 'executable_inputs'"),
    ("null exec inputs", base(executable_inputs=None), "missing 'executable_inputs'"),
    ("no exec outputs", without("executable_outputs"), "missing 'executable_outputs'"),
    ("section not list", base(executable_inputs={"x": 1}), "'executable_inputs' must be a list"),
    ("client section not list", base(client_inputs="x"), "'client_inputs' must be a list"),
    (
        "duplicate names",
        base(executable_outputs=[tensor("y", "n"), tensor("y", "n")]),
        "duplicate tensor name 'y' in 'executable_outputs'",
    ),
    (
        "duplicate client names",
        base(client_inputs=[tensor("q", "n"), tensor("q", "n")]),
        "duplicate tensor name 'q' in 'client_inputs'",
    ),
    (
        "mixed batching",
        base(
            executable_inputs=[
                tensor("a", "c", {"c": 2}),
                tensor("x", "cn", {"c": 2}),
                tensor("b", "c", {"c": 2}),
            ]
        ),
        "mixes batched and unbatched executable inputs; every executable input must carry a batch "
        "axis ('n'/'b') or none may. Unbatched input(s): a, b",
    ),
    ("batching not map", base(batching=[1]), "'batching' must be a mapping"),
    (
        "sizes not list",
        base(batching={"compiled_batch_sizes": 4}),
        "'batching.compiled_batch_sizes' must be a list",
    ),
    (
        "sizes not int",
        base(batching={"compiled_batch_sizes": [1, "2"]}),
        "'batching.compiled_batch_sizes' entries must be integers (got str)",
    ),
    (
        "size zero",
        base(batching={"compiled_batch_sizes": [1, 0]}),
        "batching.compiled_batch_sizes must be positive integers (got 0)",
    ),
    (
        "size negative",
        base(batching={"compiled_batch_sizes": [-4]}),
        "batching.compiled_batch_sizes must be positive integers (got -4)",
    ),
    (
        "sizes duplicate",
        base(batching={"compiled_batch_sizes": [2, 2]}),
        "batching.compiled_batch_sizes has duplicate entries: [2, 2]",
    ),
    (
        "fp8 executable input without client specs",
        base(executable_inputs=[tensor("x", "n", dtype="f8_e4m3")]),
        "executable_inputs tensor 'x' has dtype f8_e4m3 which has no KServe wire datatype mapping",
    ),
    (
        "fp8 client output",
        base(client_outputs=[tensor("z", "n", dtype="f8_e5m2")]),
        "client_outputs tensor 'z' has dtype f8_e5m2 which has no KServe wire datatype mapping",
    ),
    (
        "meta without meta block",
        without("meta", meta_raw()),
        "meta manifest missing 'meta' mapping",
    ),
    ("meta block not map", meta_raw(meta=["a"]), "meta manifest missing 'meta' mapping"),
    ("meta calls missing", meta_raw(meta={}), "meta manifest 'meta.calls' must be a list"),
    (
        "meta calls not list",
        meta_raw(meta={"calls": "a"}),
        "meta manifest 'meta.calls' must be a list",
    ),
    (
        "meta call not str",
        meta_raw(meta={"calls": ["a", 3]}),
        "meta manifest 'meta.calls' entries must be strings (got int)",
    ),
    (
        "meta duplicate calls",
        meta_raw(meta={"calls": ["a", "b", "a"]}),
        "meta model has duplicate entries in meta.calls: ['a']",
    ),
    (
        "meta calls itself",
        meta_raw(meta={"calls": ["a", "m"]}),
        "meta model 'm' lists itself in meta.calls",
    ),
    (
        "meta no client inputs",
        without("client_inputs", meta_raw()),
        "meta model must declare non-empty client_inputs",
    ),
    (
        "meta empty client inputs",
        meta_raw(client_inputs=[]),
        "meta model must declare non-empty client_inputs",
    ),
    (
        "meta no client outputs",
        without("client_outputs", meta_raw()),
        "meta model must declare non-empty client_outputs",
    ),
    (
        "meta input_shapes",
        meta_raw(input_shapes=[{"w": 1}]),
        "meta model must not declare 'input_shapes'",
    ),
    (
        "meta fp8 client input",
        meta_raw(client_inputs=[tensor("q", "n", dtype="f8_e5m2")]),
        "client_inputs tensor 'q' has dtype f8_e5m2 which has no KServe wire datatype mapping",
    ),
]


@pytest.mark.parametrize(
    "raw, rule", [t[1:] for t in MANIFEST_RULES], ids=[t[0] for t in MANIFEST_RULES]
)
def test_manifest_rules(raw: Any, rule: str) -> None:
    assert manifest_error(raw) == P + rule


def test_fp8_is_allowed_on_executable_tensors_behind_client_specs() -> None:
    m = parse(
        base(
            executable_inputs=[tensor("x", "n", dtype="f8_e4m3")],
            executable_outputs=[tensor("y", "n", dtype="f8_e5m2")],
            client_inputs=[tensor("q", "n", dtype="bf16")],
            client_outputs=[tensor("r", "n", dtype="f16")],
        )
    )
    assert m.executable_inputs[0].dtype is DType.F8_E4M3
    assert [t.name for t in m.wire_inputs] == ["q"]
    assert [t.name for t in m.wire_outputs] == ["r"]


def test_meta_manifest_parses_without_executable_sections() -> None:
    m = parse(meta_raw(), "orchestrator")
    assert m.is_meta and is_meta(m)
    assert m.meta_calls == ("a", "b")
    assert m.executable_inputs == () and m.executable_outputs == ()
    assert wire_batch_spec(m) == ("q", 0)
    assert parse(meta_raw(meta={"calls": []})).meta_calls == ()


# ----------------------------------------------------------------------------- input_shapes


def detector(**over: Any) -> dict[str, Any]:
    raw = base(
        executable_inputs=[
            tensor("img", "whcn", {"w": -1, "h": -1, "c": 3}),
            tensor("mask", "whn", {"w": -1, "h": -1}),
        ],
        input_shapes=[{"w": 1024, "h": 1024}, {"w": 1448, "h": 720}],
    )
    raw.update(over)
    return raw


def test_input_shapes_resolve_variable_axes_in_row_major_order() -> None:
    m = parse(detector())
    # img is wire (n, c, h, w): h at dim 2, w at dim 3; mask is wire (n, h, w).
    assert m.variable_axes == (
        VariableAxis("img", 2, "h"),
        VariableAxis("img", 3, "w"),
        VariableAxis("mask", 1, "h"),
        VariableAxis("mask", 2, "w"),
    )
    assert m.input_shapes == ({"w": 1024, "h": 1024}, {"w": 1448, "h": 720})
    assert m.variant_keys == ((1024, 1024, 1024, 1024), (720, 1448, 720, 1448))
    assert m.executable_inputs[0].wire_shape() == [-1, 3, -1, -1]


def test_variant_index_selects_the_compiled_variant() -> None:
    m = parse(detector())
    assert m.variant_index({"img": (2, 3, 720, 1448), "mask": (2, 720, 1448)}) == 1
    assert m.variant_index({"img": (1, 3, 1024, 1024), "mask": (1, 1024, 1024)}) == 0


def test_variant_index_unknown_key_is_invalid_argument() -> None:
    m = parse(detector(), "det")
    with pytest.raises(InvalidArgument) as ei:
        m.variant_index({"img": (1, 3, 720, 1024), "mask": (1, 720, 1024)})
    assert str(ei.value) == (
        "no compiled program for input shape variant [720, 1024, 720, 1024] "
        "(have [[1024, 1024, 1024, 1024], [720, 1448, 720, 1448]]) in model 'det'"
    )


def test_variant_index_missing_input_or_rank() -> None:
    m = parse(detector(), "det")
    with pytest.raises(InvalidArgument) as ei:
        m.variant_index({"img": (1, 3, 720, 1448)})
    assert str(ei.value) == (
        "model 'det': input 'mask' is missing; cannot select an input shape variant"
    )
    with pytest.raises(InvalidArgument) as ei:
        m.variant_index({"img": (1, 3), "mask": (1, 720, 1448)})
    assert str(ei.value) == "model 'det': input 'img' has 2 dims; variable axis 'h' is dim 2"


def test_variable_axes_on_client_inputs_need_no_input_shapes() -> None:
    m = parse(base(client_inputs=[tensor("img", "bd", {"d": -1}, dtype="u8")]))
    assert m.variable_axes == () and m.variant_keys == ()


INPUT_SHAPE_ERRORS = [
    ("not a list", detector(input_shapes={"w": 1}), "'input_shapes' must be a list"),
    (
        "no variable axis",
        base(input_shapes=[{"w": 1}]),
        "declares 'input_shapes' but no executable input has a variable axis (a -1 in its dims)",
    ),
    (
        "entry not mapping",
        detector(input_shapes=[[1, 2]]),
        "input_shapes[0] must be a mapping of axis letters to sizes",
    ),
    (
        "key not letter",
        detector(input_shapes=[{"w": 1, "h": 1, "hh": 2}]),
        "input_shapes[0] key 'hh' is not a single ASCII letter",
    ),
    (
        "value not int",
        detector(input_shapes=[{"w": 1.5, "h": 1}]),
        "input_shapes[0]['w'] is not an integer (got float)",
    ),
    (
        "value zero",
        detector(input_shapes=[{"w": 2, "h": 2}, {"w": 0, "h": 1}]),
        "input_shapes[1]['w']=0 must be > 0",
    ),
    ("value -1", detector(input_shapes=[{"w": -1, "h": 1}]), "input_shapes[0]['w']=-1 must be > 0"),
    (
        "non-variable letter",
        detector(input_shapes=[{"w": 1, "h": 1, "c": 3}]),
        "input_shapes[0] has sizes for non-variable axes: ['c']",
    ),
    (
        "missing letter",
        detector(input_shapes=[{"w": 1}]),
        "input_shapes[0] missing a size for variable axis 'h'",
    ),
    (
        "duplicate variant",
        detector(input_shapes=[{"w": 1, "h": 2}, {"w": 3, "h": 3}, {"h": 2, "w": 1}]),
        "has duplicate entries in input_shapes (input_shapes[2] repeats input_shapes[0])",
    ),
    (
        "absent with variable axis",
        without("input_shapes", detector()),
        "has a variable executable-input axis but no 'input_shapes' to enumerate the compiled "
        "shapes (input 'img' axis 'h')",
    ),
    (
        "empty with variable axis",
        detector(input_shapes=[]),
        "has a variable executable-input axis but no 'input_shapes' to enumerate the compiled "
        "shapes (input 'img' axis 'h')",
    ),
]


@pytest.mark.parametrize(
    "raw, rule", [t[1:] for t in INPUT_SHAPE_ERRORS], ids=[t[0] for t in INPUT_SHAPE_ERRORS]
)
def test_input_shapes_rules(raw: Any, rule: str) -> None:
    assert manifest_error(raw) == P + rule


# ----------------------------------------------------------------------------- batch questions


@pytest.mark.parametrize(
    "inputs, expected",
    [
        ([tensor("x", "whcn", {"w": 2, "h": 2, "c": 3})], ("x", 0)),
        ([tensor("x", "cn", {"c": 3})], ("x", 0)),
        ([tensor("x", "nc", {"c": 3})], ("x", 1)),
        ([tensor("x", "c", {"c": 3})], None),
    ],
    ids=["whcn", "cn", "nc", "none"],
)
def test_wire_batch_spec_reports_the_row_major_axis(inputs: list, expected: Any) -> None:
    m = parse(base(executable_inputs=inputs))
    assert wire_batch_spec(m) == expected
    assert executable_batch_spec(m) == expected


def test_wire_batch_spec_prefers_client_inputs_and_the_first_batched_one() -> None:
    m = parse(
        base(
            client_inputs=[
                tensor("query", "d", {"d": 8}),
                tensor("keys", "nd", {"d": 8}),
                tensor("more", "dn", {"d": 8}),
            ]
        )
    )
    assert wire_batch_spec(m) == ("keys", 1)
    assert executable_batch_spec(m) == ("x", 0)


def test_request_rows() -> None:
    m = parse(base(client_inputs=[tensor("query", "d", {"d": 8}), tensor("keys", "nd", {"d": 8})]))
    assert request_rows(m, {"query": [8], "keys": [8, 5]}) == 5
    unbatched = parse(base(executable_inputs=[tensor("x", "c", {"c": 3})]))
    assert request_rows(unbatched, {"x": [3]}) == 1
    assert request_rows(parse(base()), {"x": (6, 3, 4, 5)}) == 6


def test_request_rows_errors() -> None:
    m = parse(base(), "net")
    with pytest.raises(InvalidArgument) as ei:
        request_rows(m, {"other": [1]})
    assert str(ei.value) == "model 'net': required input 'x' is missing"
    nc = parse(base(executable_inputs=[tensor("x", "nc", {"c": 3})]), "net")
    with pytest.raises(InvalidArgument) as ei:
        request_rows(nc, {"x": [3]})
    assert str(ei.value) == "model 'net': input 'x' has 1 dims; its batch axis is dim 1"


def test_tensor_spec_matches() -> None:
    x = parse(base()).executable_inputs[0]  # (-1, 3, 4, 5)
    assert x.matches([7, 3, 4, 5]) is None
    assert x.matches([0, 3, 4, 5]) is None
    assert x.matches([7, 3, 4]) == "has 3 dims, expected 4"
    assert x.matches([7, 3, 5, 4]) == "dim 2 has extent 5, expected 4"
    assert x.matches([-1, 3, 4, 5]) == "dim 0 has negative extent -1"
    v = parse_tensor_spec(tensor("v", "dn", {"d": -1}))
    assert v.matches([2, 99]) is None


# ----------------------------------------------------------------------------- bundle directory


def write_bundle(root: Path, name: str, raw: dict[str, Any], files: list[str]) -> Path:
    from ruamel.yaml import YAML

    d = root / name
    d.mkdir()
    with (d / "manifest.yaml").open("w") as fh:
        YAML(typ="safe").dump(raw, fh)
    for f in files:
        (d / f).write_bytes(b"x")
    return d


def bundle_error(d: Path) -> str:
    with pytest.raises(BundleError) as ei:
        validate_manifest(d)
    return str(ei.value)


def test_discover_b_files_with_extras_and_sidecars(tmp_path: Path) -> None:
    files = ["model.b1.mlir", "model.b2.mlir", "model.b4.mlir", "model.b8.mlir", "model.mlir"]
    files += ["model.b1.jaxexport", "weights.safetensors", "model.v0.mlir"]
    d = write_bundle(tmp_path, "net", base(), files)
    m = validate_manifest(d)
    mods = discover_modules(d, m)
    assert mods == {None: {n: d / f"model.b{n}.mlir" for n in (1, 2, 4, 8)}}
    assert list(mods[None]) == [1, 2, 4, 8]


def test_discover_plain_model_mlir_under_key_zero(tmp_path: Path) -> None:
    d = write_bundle(tmp_path, "net", base(), ["model.mlir", "weights.safetensors"])
    assert discover_modules(d, validate_manifest(d)) == {None: {0: d / "model.mlir"}}


def test_discover_variants(tmp_path: Path) -> None:
    files = ["model.v0.b1.mlir", "model.v0.b2.mlir", "model.v0.b4.mlir", "model.v1.mlir"]
    files += ["model.v1.jaxexport", "model.v2.mlir", "model.mlir", "weights.safetensors"]
    d = write_bundle(tmp_path, "det", detector(), files)
    m = validate_manifest(d)
    assert discover_modules(d, m) == {
        0: {1: d / "model.v0.b1.mlir", 2: d / "model.v0.b2.mlir", 4: d / "model.v0.b4.mlir"},
        1: {0: d / "model.v1.mlir"},
    }


@pytest.mark.parametrize(
    "raw, files, rule",
    [
        (
            base(),
            ["model.b1.mlir", "model.b4.mlir"],
            "declares batch size 2 but has no model.b2.mlir",
        ),
        (base(), ["model.v0.mlir"], "has no model.mlir or model.b{N}.mlir"),
        (
            detector(),
            ["model.v0.b1.mlir", "model.v0.b2.mlir", "model.v0.b4.mlir"],
            "has no model.v1.mlir or model.v1.b{N}.mlir",
        ),
        (
            detector(),
            ["model.v0.mlir", "model.v1.b1.mlir"],
            "declares batch size 2 but has no model.v1.b2.mlir",
        ),
        (
            base(),
            ["model.b1.mlir", "model.b2.mlir", "model.b4.mlir", "model.b04.mlir"],
            "module file 'model.b04.mlir' must name a positive batch size without leading zeros",
        ),
        (
            base(),
            ["model.b0.mlir"],
            "module file 'model.b0.mlir' must name a positive batch size without leading zeros",
        ),
        (
            base(executable_inputs=[tensor("x", "c", {"c": 3})]),
            ["model.b1.mlir", "model.b2.mlir", "model.b4.mlir"],
            "multiple compiled batch sizes but no input with a batch axis ('n'/'b')",
        ),
        (base(), ["model.mlir"], "missing weights.safetensors"),
    ],
    ids=[
        "missing-b",
        "no-module",
        "variant-missing",
        "variant-missing-b",
        "leading-zero",
        "b0",
        "multi-unbatched",
        "no-weights",
    ],
)
def test_bundle_module_rules(tmp_path: Path, raw: dict, files: list[str], rule: str) -> None:
    d = write_bundle(tmp_path, "net", raw, files)
    assert bundle_error(d) == f"bundle 'net' ({d}): {rule}"


def test_single_size_without_batch_axis_is_fine(tmp_path: Path) -> None:
    raw = base(
        executable_inputs=[tensor("x", "c", {"c": 3})], batching={"compiled_batch_sizes": [1]}
    )
    d = write_bundle(tmp_path, "net", raw, ["model.b1.mlir", "weights.safetensors"])
    assert discover_modules(d, validate_manifest(d)) == {None: {1: d / "model.b1.mlir"}}


def test_missing_manifest_is_a_bundle_error(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    assert bundle_error(d) == f"bundle 'empty' ({d}): missing manifest.yaml"


def test_client_specs_require_model_py(tmp_path: Path) -> None:
    raw = base(client_inputs=[tensor("q", "n")])
    d = write_bundle(tmp_path, "net", raw, ["model.mlir", "weights.safetensors"])
    with pytest.raises(ManifestError) as ei:
        validate_manifest(d)
    assert str(ei.value) == (
        f"manifest 'net' ({d / 'manifest.yaml'}): "
        "client_inputs/client_outputs are only valid when model.py is present"
    )
    (d / "model.py").write_text("")
    assert [t.name for t in validate_manifest(d).wire_inputs] == ["q"]


def test_meta_requires_model_py_but_no_modules_or_weights(tmp_path: Path) -> None:
    d = write_bundle(tmp_path, "orch", meta_raw(), [])
    with pytest.raises(ManifestError) as ei:
        validate_manifest(d)
    assert str(ei.value) == (
        f"manifest 'orch' ({d / 'manifest.yaml'}): "
        "meta model requires a model.py that calls register_meta_model"
    )
    (d / "model.py").write_text("")
    m = validate_manifest(d)
    assert m.is_meta and m.name == "orch"
    assert discover_modules(d, m) == {}


def test_manifest_errors_surface_through_validate_manifest(tmp_path: Path) -> None:
    d = write_bundle(tmp_path, "net", base(kind="ensemble"), ["model.mlir", "weights.safetensors"])
    with pytest.raises(ManifestError) as ei:
        validate_manifest(d)
    assert str(ei.value) == (
        f"manifest 'net' ({d / 'manifest.yaml'}): unsupported kind 'ensemble'; supported: model, meta"
    )


def test_load_manifest_file_errors(tmp_path: Path) -> None:
    d = tmp_path / "bad"
    d.mkdir()
    path = d / "manifest.yaml"
    with pytest.raises(ManifestError) as ei:
        load_manifest(path)
    assert str(ei.value) == f"manifest 'bad' ({path}): cannot read: No such file or directory"
    path.write_text("format_version: [unclosed\n")
    with pytest.raises(ManifestError) as ei:
        load_manifest(path)
    assert str(ei.value).startswith(f"manifest 'bad' ({path}): invalid YAML: ")
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(ManifestError, match=r"invalid YAML: .*duplicate key"):
        load_manifest(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ManifestError) as ei:
        load_manifest(path)
    assert str(ei.value) == f"manifest 'bad' ({path}): manifest is not a mapping (got list)"


def test_bundle_signature_files_include_variant_modules(tmp_path: Path) -> None:
    files = [
        "model.mlir",
        "model.b2.mlir",
        "model.v1.b4.mlir",
        "model.v0.mlir",
        "model.v0.jaxexport",
    ]
    files += ["weights.safetensors", "model.py", "working_tree.patch", "notes.txt", "other.mlir"]
    d = write_bundle(tmp_path, "net", base(), files)
    (d / "model.sub.mlir").mkdir()
    names = [p.name for p in bundle_signature_files(d)]
    assert names == [
        "manifest.yaml",
        "model.b2.mlir",
        "model.mlir",
        "model.py",
        "model.v0.jaxexport",
        "model.v0.mlir",
        "model.v1.b4.mlir",
        "weights.safetensors",
    ]
    assert all(p.parent == d for p in bundle_signature_files(d))
    assert bundle_signature_files(tmp_path / "gone") == []


# --------------------------------------------------------------------------------------------
# The bundle module's file names (one home for every name of the format)
# --------------------------------------------------------------------------------------------


def test_module_file_names_follow_the_variant_and_batch_rule() -> None:
    from kserve_trio.core.bundles import bundle

    assert bundle.module_file(None, 0) == "model.mlir"
    assert bundle.module_file(None, 8) == "model.b8.mlir"
    assert bundle.module_file(2, 0) == "model.v2.mlir"
    assert bundle.module_file(0, 32) == "model.v0.b32.mlir"
    assert bundle.sidecar_file("model.v1.b4.mlir") == "model.v1.b4.jaxexport"
    assert bundle.sidecar_path(Path("/b/net/model.mlir")) == Path("/b/net/model.jaxexport")
    assert bundle.serving_name("/repo/net/") == "net"


def test_discovery_finds_exactly_the_files_module_file_names(tmp_path: Path) -> None:
    """What a producer names with ``module_file`` is what ``discover_modules`` finds."""
    from kserve_trio.core.bundles.bundle import module_file

    raw = base(batching={"compiled_batch_sizes": [1, 4]})
    files = [module_file(None, 1), module_file(None, 4), "weights.safetensors"]
    d = write_bundle(tmp_path, "net", raw, files)
    assert discover_modules(d, validate_manifest(d)) == {
        None: {1: d / "model.b1.mlir", 4: d / "model.b4.mlir"}
    }


def test_program_files_and_module_files(tmp_path: Path) -> None:
    from kserve_trio.core.bundles.bundle import is_bundle_dir, is_program_file, module_files

    for name in ("model.mlir", "model.v1.b2.mlir", "model.b4.jaxexport"):
        assert is_program_file(name)
    for name in ("model.py", "manifest.yaml", "weights.safetensors", "other.mlir"):
        assert not is_program_file(name)
    d = tmp_path / "net"
    d.mkdir()
    for name in ("model.b32.mlir", "model.b8.mlir", "model.b8.jaxexport", "x.mlir", "model.py"):
        (d / name).write_text("")
    assert module_files(d) == ["model.b8.mlir", "model.b32.mlir"]
    assert not is_bundle_dir(d)
    (d / "manifest.yaml").write_text("")
    assert is_bundle_dir(d)
    assert not is_bundle_dir(d / "manifest.yaml")


def test_manifest_and_bundle_state_their_public_surfaces() -> None:
    import kserve_trio.core.bundles.bundle as bundle
    import kserve_trio.core.bundles.manifest as manifest

    assert sorted(manifest.__all__) == [
        "BATCH_LETTERS",
        "BatchingSpec",
        "Dim",
        "DimKind",
        "Manifest",
        "SUPPORTED_FORMAT_VERSIONS",
        "SUPPORTED_KINDS",
        "TensorSpec",
        "VariableAxis",
        "executable_batch_spec",
        "is_meta",
        "parse_manifest",
        "parse_manifest_text",
        "parse_tensor_spec",
        "request_rows",
        "wire_batch_spec",
    ]
    assert sorted(bundle.__all__) == [
        "FORMAT_VERSION",
        "JAXEXPORT_SUFFIX",
        "MANIFEST_FILE",
        "MODEL_JL",
        "MODEL_PY",
        "MODULE_PREFIX",
        "MODULE_SUFFIX",
        "PATCH_FILE",
        "PORTING_GUIDE",
        "WEIGHTS_FILE",
        "bundle_signature_files",
        "discover_modules",
        "is_bundle_dir",
        "is_program_file",
        "load_manifest",
        "module_file",
        "module_files",
        "serving_name",
        "sidecar_file",
        "sidecar_path",
        "validate_manifest",
    ]
    for mod in (manifest, bundle):
        for name in mod.__all__:
            assert getattr(mod, name) is not None


def test_manifest_text_parses_without_touching_the_filesystem() -> None:
    from kserve_trio.core.bundles.manifest import parse_manifest_text

    text = "format_version: '2'\nexecutable_inputs: []\nexecutable_outputs: []\n"
    assert parse_manifest_text(text, "net").name == "net"
    with pytest.raises(ManifestError, match=r"^manifest 'net' \(<manifest>\): invalid YAML: "):
        parse_manifest_text("a: [", "net")
