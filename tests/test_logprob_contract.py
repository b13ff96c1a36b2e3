"""The typed contract: every invalid field fails at construction, naming the field and the value."""

from __future__ import annotations

import re

import pytest
import torch

import kernels

VOCAB, TILE, TP = 1000, 64, 4


def contract(**overrides) -> kernels.LogprobContract:
    kwargs = {"dtype": torch.bfloat16, "platform": "cpu", **overrides}
    return kernels.LogprobContract.even(VOCAB, TILE, kwargs.pop("tp", TP), **kwargs)


def capability(**overrides) -> kernels.LogprobBackendCapability:
    fields = {
        "implementation_kind": kernels.ImplementationKind.PRODUCTION,
        "dtypes": {"bfloat16"},
        "determinism_scopes": set(kernels.DeterminismScope),
        "merge_orders": {kernels.MergeOrder.GLOBAL_TILE},
        **overrides,
    }
    return kernels.LogprobBackendCapability(**fields)


def sharding() -> kernels.ShardingSpec:
    return kernels.ShardingSpec.even(VOCAB, TILE, TP)


def reduction() -> kernels.ReductionSpec:
    return kernels.ReductionSpec(TILE)


# (what to build, the field the message must name, the offending value's repr)
CONSTRUCTION_ERRORS = [
    (lambda: kernels.MaskSpec(mode="bitmask"), "mask.mode", "'bitmask'"),
    (lambda: kernels.MaskSpec(ignore_index=5), "mask.ignore_index", "5"),
    (lambda: kernels.MaskSpec(ignore_index=True), "mask.ignore_index", "True"),
    (lambda: kernels.MaskSpec(ignore_index=None), "mask.ignore_index", "None"),
    (lambda: kernels.MaskSpec(kernels.MaskMode.ACTIVE_MASK, kernels.IGNORE_INDEX), "mask.ignore_index", "-100"),
    (lambda: kernels.ReductionSpec(48), "reduction.vocab_tile", "48"),
    (lambda: kernels.ReductionSpec(8), "reduction.vocab_tile", "8"),
    (lambda: kernels.ReductionSpec("64"), "reduction.vocab_tile", "'64'"),
    (
        lambda: kernels.ReductionSpec(TILE, determinism_scope="run_to_run"),
        "reduction.determinism_scope",
        "'run_to_run'",
    ),
    (lambda: kernels.ReductionSpec(TILE, merge_order="tree"), "reduction.merge_order", "'tree'"),
    (lambda: kernels.ReductionSpec(TILE, partial_dtype="float16"), "reduction.partial_dtype", "'float16'"),
    (lambda: kernels.ReductionSpec(TILE, transport="reduce_scatter"), "reduction.transport", "'reduce_scatter'"),
    (
        lambda: kernels.ReductionSpec(TILE, merge_order=kernels.MergeOrder.RANK_SHARD),
        "reduction.merge_order",
        repr(kernels.MergeOrder.RANK_SHARD.value),
    ),
    (lambda: kernels.LogprobOutputSpec(dtype="bfloat16"), "output.dtype", "'bfloat16'"),
    (lambda: kernels.LogprobOutputSpec(export_lse="yes"), "output.export_lse", "'yes'"),
    (lambda: kernels.LogprobContract({"rank": 0}, reduction(), "bfloat16", "cpu"), "sharding", "{'rank': 0}"),
    (lambda: kernels.LogprobContract(sharding(), TILE, "bfloat16", "cpu"), "reduction", "64"),
    (lambda: kernels.LogprobContract(sharding(), reduction(), "bfloat16", "cpu", mask=-100), "mask", "-100"),
    (lambda: kernels.LogprobContract(sharding(), reduction(), "bfloat16", "cpu", output="fp32"), "output", "'fp32'"),
    (lambda: kernels.LogprobContract(sharding(), reduction(), torch.float16, "cpu"), "dtype", "torch.float16"),
    (lambda: kernels.LogprobContract(sharding(), reduction(), "bfloat16", "rocm"), "platform", "'rocm'"),
    (lambda: kernels.LogprobContract(sharding(), kernels.ReductionSpec(128), "bfloat16", "cpu"), "vocab_tile", "128"),
    (lambda: capability(implementation_kind="fast"), "capability.implementation_kind", "'fast'"),
    (lambda: capability(dtypes=set()), "capability.dtypes", "set()"),
    (lambda: capability(dtypes="bfloat16"), "capability.dtypes", "'bfloat16'"),
    (lambda: capability(dtypes={"float16"}), "capability.dtypes", "'float16'"),
    (lambda: capability(determinism_scopes={"always"}), "capability.determinism_scopes", "'always'"),
    (lambda: capability(merge_orders={"tree"}), "capability.merge_orders", "'tree'"),
    (lambda: capability(mask_modes={"bits"}), "capability.mask_modes", "'bits'"),
    (lambda: capability(tp_sizes={0}), "capability.tp_sizes", "0"),
    (lambda: capability(partial_dtype="half"), "capability.partial_dtype", "'half'"),
    (lambda: capability(output_dtype="int8"), "capability.output_dtype", "'int8'"),
    (lambda: capability(supports_vocab_padding=1), "capability.supports_vocab_padding", "1"),
    (lambda: capability(exports_lse=None), "capability.exports_lse", "None"),
    (lambda: capability(ignore_index="-100"), "capability.ignore_index", "'-100'"),
]


@pytest.mark.parametrize(("build", "field", "value"), CONSTRUCTION_ERRORS)
def test_invalid_field_fails_at_construction_naming_field_and_value(build, field, value):
    with pytest.raises(kernels.LogprobContractError, match=rf"{re.escape(field)}.*{re.escape(value)}"):
        build()


@pytest.mark.parametrize(
    ("build", "value"),
    [
        (lambda: kernels.ShardingSpec(2, 2, VOCAB, 1024, TILE, ((0, 512), (512, 1024))), "2"),
        (lambda: kernels.ShardingSpec(0, 2, VOCAB, 1024, TILE, ((0, 512), (576, 1024))), "(576, 1024)"),
        (lambda: kernels.ShardingSpec(0, 1, VOCAB, 960, TILE, ((0, 960),)), "960"),
    ],
)
def test_the_contract_reuses_sharding_validation(build, value):
    with pytest.raises(kernels.TPConfigError, match=re.escape(value)):
        build()


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: kernels.ShardingSpec.even(VOCAB, TILE, 2, rank="1"), r"rank must be an integer in \[0, 2\), got '1'"),
        (lambda: kernels.ShardingSpec.even(VOCAB, TILE, 2, rank=1.0), r"rank must be an integer .*got 1.0"),
        (lambda: kernels.ShardingSpec.even(VOCAB, TILE, 2, rank=True), r"rank must be an integer .*got True"),
        (lambda: kernels.ShardingSpec.even(True, TILE, 1), r"vocab size must be an integer >= 1, got True"),
        (lambda: kernels.ShardingSpec(0, 1, VOCAB, "1024", TILE, ((0, 1024),)), r"padded_vocab_size .*got '1024'"),
        (lambda: kernels.ShardingSpec(0, 1, VOCAB, 1024.0, TILE, ((0, 1024),)), r"padded_vocab_size .*got 1024.0"),
        (lambda: kernels.ShardingSpec(0, 1, VOCAB, 1024, TILE, ((0,),)), r"bounds must be a tuple of one \(lo, hi\)"),
        (lambda: kernels.ShardingSpec(0, 1, VOCAB, 1024, TILE, None), r"bounds must be .*got None"),
        (lambda: kernels.ShardingSpec(0, 1, VOCAB, 1024, TILE, [(0, 1024)]), r"bounds must be .*got \[\(0, 1024\)\]"),
        (lambda: kernels.ShardingSpec.even(VOCAB, TILE, 1).owner_rank("3"), r"token id '3' is not an integer"),
        (lambda: kernels.ShardingSpec.even(VOCAB, TILE, 1).owner_rank(3.5), r"token id 3.5 is not an integer"),
        (lambda: kernels.LogprobContract.even(VOCAB, TILE, 2, dtype="float32", platform="cpu", rank="1"), "'1'"),
    ],
)
def test_sharding_fields_of_the_wrong_type_are_refused_by_name(build, match):
    """Not a bare TypeError from a comparison, nor a float rank or a bool vocab taken as the number it equals."""
    with pytest.raises(kernels.TPConfigError, match=match):
        build()


def test_strings_and_dtypes_normalize_to_the_same_contract():
    scope, order = kernels.DeterminismScope.FIXED_TOPOLOGY, kernels.MergeOrder.RANK_SHARD
    typed = contract(determinism_scope=scope, merge_order=order)
    # Configs spell the vocabularies as strings; they must parse to the same members.
    spelled = contract(dtype="bfloat16", determinism_scope=scope.value, merge_order=order.value)
    assert typed == spelled
    assert spelled.reduction.determinism_scope is scope


def test_to_dict_is_plain_json_values():
    record = contract().to_dict()
    assert record["sharding"]["bounds"] == [[0, 256], [256, 512], [512, 768], [768, 1024]]
    assert record["reduction"]["determinism_scope"] == kernels.DeterminismScope.CROSS_TP_BITWISE.value
    assert type(record["reduction"]["determinism_scope"]) is str
    assert record["mask"] == {"mode": kernels.MaskMode.IGNORE_INDEX.value, "ignore_index": kernels.IGNORE_INDEX}


def test_fingerprint_is_equal_on_every_rank():
    per_rank = [contract(rank=r) for r in range(TP)]
    assert len({c.to_dict()["sharding"]["rank"] for c in per_rank}) == TP
    assert len({c.cross_rank_fingerprint() for c in per_rank}) == 1


def _wider_padding() -> kernels.LogprobContract:
    """The same vocab and tile with one more padding tile per rank than the even split."""
    padded = kernels.padded_vocab_size(VOCAB, TILE, TP) + TILE * TP
    width = padded // TP
    bounds = tuple((r * width, (r + 1) * width) for r in range(TP))
    split = kernels.ShardingSpec(0, TP, VOCAB, padded, TILE, bounds)
    return kernels.LogprobContract(split, reduction(), "bfloat16", "cpu")


VARIANTS = {
    "vocab_size": lambda: kernels.LogprobContract.even(VOCAB + 1, TILE, TP, dtype="bfloat16", platform="cpu"),
    "vocab_tile": lambda: kernels.LogprobContract.even(VOCAB, TILE * 2, TP, dtype="bfloat16", platform="cpu"),
    "tp": lambda: contract(tp=2),
    "padding": _wider_padding,
    "dtype": lambda: contract(dtype=torch.float32),
    "platform": lambda: contract(platform="cuda"),
    "determinism_scope": lambda: contract(determinism_scope=kernels.DeterminismScope.FIXED_TOPOLOGY),
    "merge_order": lambda: contract(
        determinism_scope=kernels.DeterminismScope.FIXED_TOPOLOGY, merge_order=kernels.MergeOrder.RANK_SHARD
    ),
    "partial_dtype": lambda: kernels.LogprobContract(
        sharding(), kernels.ReductionSpec(TILE, partial_dtype="float64"), "bfloat16", "cpu"
    ),
    "ignore_index": lambda: contract(mask=kernels.MaskSpec(ignore_index=-1)),
    "mask_mode": lambda: contract(mask=kernels.MaskSpec(kernels.MaskMode.ACTIVE_MASK, None)),
    "output_dtype": lambda: contract(output=kernels.LogprobOutputSpec(dtype="float64")),
    "export_lse": lambda: contract(output=kernels.LogprobOutputSpec(export_lse=False)),
}


def _leaves(record: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_fingerprint_differs_when_any_non_rank_field_differs():
    base = contract()
    variants = {name: build() for name, build in VARIANTS.items()}
    fingerprints = [base.cross_rank_fingerprint(), *(c.cross_rank_fingerprint() for c in variants.values())]
    assert len(set(fingerprints)) == len(fingerprints)
    # Every field but the rank is varied by some variant; transport has a single legal value.
    base_leaves = _leaves(base.to_dict())
    varied = {
        key for c in variants.values() for key, value in _leaves(c.to_dict()).items() if base_leaves[key] != value
    }
    assert varied == set(base_leaves) - {"sharding.rank", "reduction.transport"}
