"""Capability-gated dispatch: typed refusals with every candidate's reasons, and observed provenance."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import kernels

VOCAB, TILE = 200, 16
SCOPE, ORDER, MASK = kernels.DeterminismScope, kernels.MergeOrder, kernels.MaskMode
FIXED = {"determinism_scope": SCOPE.FIXED_TOPOLOGY, "merge_order": ORDER.RANK_SHARD}


pytestmark = pytest.mark.usefixtures("isolated_registries")


def contract(tp: int = 2, **overrides) -> kernels.LogprobContract:
    kwargs = {"dtype": torch.float32, "platform": "cpu", **overrides}
    return kernels.LogprobContract.even(VOCAB, TILE, tp, **kwargs)


def permissive(**overrides) -> kernels.LogprobBackendCapability:
    """A capability that honours the default contract, with one field narrowed by the caller."""
    fields = {
        "implementation_kind": kernels.ImplementationKind.PRODUCTION,
        "dtypes": {kernels.dtype_name(d) for d in (torch.bfloat16, torch.float32)},
        "determinism_scopes": set(kernels.DeterminismScope),
        "merge_orders": set(kernels.MergeOrder),
        **overrides,
    }
    return kernels.LogprobBackendCapability(**fields)


def inputs(rows: int = 5, hidden: int = 8, vocab: int = VOCAB, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[1] = kernels.IGNORE_INDEX
    return (
        torch.randn(rows, hidden, generator=gen).to(dtype),
        torch.randn(vocab, hidden, generator=gen).to(dtype),
        targets,
    )


def register(backend_id: str, capability: kernels.LogprobBackendCapability, **kwargs) -> None:
    """Register ``backend_id`` with ``capability``, its code and kernel declarations being aten's."""
    aten = kernels.BACKENDS["aten"]
    kernels.register_backend(backend_id, kernels=aten.declared_kernels, capability=capability, **kwargs)(type(aten))


@pytest.fixture
def fake():
    """Register backend id "fake" (on every platform unless the capability says otherwise) with a given capability."""

    def declare(capability: kernels.LogprobBackendCapability) -> None:
        register("fake", capability)

    return declare


# (a capability narrowed in one field, a contract outside it, the one reason dispatch must give)
REJECTIONS = {
    "dtype": (permissive(dtypes={"bfloat16"}), contract(), "dtype 'float32' unsupported (supports bfloat16)"),
    "tp size": (permissive(tp_sizes={1, 4}), contract(tp=2), "tp=2 unsupported (supports 1, 4)"),
    "mask mode": (
        permissive(),
        contract(mask=kernels.MaskSpec(kernels.MaskMode.ACTIVE_MASK, None)),
        f"mask mode '{MASK.ACTIVE_MASK.value}' unsupported (supports {MASK.IGNORE_INDEX.value})",
    ),
    "ignore_index": (
        permissive(),
        contract(mask=kernels.MaskSpec(ignore_index=-1)),
        "ignore_index=-1 unsupported (the backend uses -100)",
    ),
    "determinism scope": (
        permissive(determinism_scopes={kernels.DeterminismScope.FIXED_TOPOLOGY}),
        contract(),
        f"determinism scope '{SCOPE.CROSS_TP_BITWISE.value}' not guaranteed (guarantees {SCOPE.FIXED_TOPOLOGY.value})",
    ),
    "merge order": (
        permissive(merge_orders={kernels.MergeOrder.RANK_SHARD}),
        contract(determinism_scope=kernels.DeterminismScope.FIXED_TOPOLOGY),
        f"merge order '{ORDER.GLOBAL_TILE.value}' unsupported (merges {ORDER.RANK_SHARD.value})",
    ),
    "partial dtype": (
        permissive(partial_dtype="float64"),
        contract(),
        "partial dtype 'float32' unsupported (computes 'float64')",
    ),
    "output dtype": (
        permissive(),
        contract(output=kernels.LogprobOutputSpec(dtype="float64")),
        "output dtype 'float64' unsupported (returns 'float32')",
    ),
    "vocab padding": (
        permissive(supports_vocab_padding=False),
        contract(),
        f"vocab padding ({VOCAB} -> {kernels.padded_vocab_size(VOCAB, TILE, 2)} columns) unsupported",
    ),
    "lse export": (
        permissive(exports_lse=False),
        contract(),
        "lse export requested but the backend does not export lse",
    ),
}


@pytest.mark.parametrize("reason", REJECTIONS)
def test_each_incompatibility_is_the_one_reason_given(reason, fake):
    capability, wanted, message = REJECTIONS[reason]
    fake(capability)
    with pytest.raises(kernels.LogprobDispatchError, match=re.escape(f"fake: {message}")) as err:
        kernels.get_logprob_op(wanted, "fake")
    assert err.value.rejections == {"fake": [message]}


def test_a_backend_that_fits_is_bound_with_the_capability_it_was_chosen_under(fake):
    fake(permissive())
    op = kernels.get_logprob_op(contract(), "fake")
    assert (op.backend_id, op.policy, op.tp, op.vocab_tile) == ("fake", kernels.DispatchPolicy.EXPLICIT, 2, TILE)
    assert op.capability == permissive()
    assert op.capability is kernels.BACKENDS["fake"].capability
    record = op.to_dict()
    assert record["contract_fingerprint"] == contract().cross_rank_fingerprint()
    assert (record["policy"], record["backend_id"]) == (kernels.DispatchPolicy.EXPLICIT.value, "fake")
    assert record["capability"]["platforms"] == list(kernels.PLATFORMS)
    assert record["capability"]["tp_modes"] == sorted(kernels.TP_MODES)


def test_a_backend_declared_for_one_platform_is_refused_on_another_and_a_candidate_on_its_own(monkeypatch):
    register("cuda_only", permissive(platforms=frozenset({"cuda"})))
    assert "cuda_only" in kernels.registered_backends("cuda")
    assert "cuda_only" not in kernels.registered_backends("cpu")
    with pytest.raises(kernels.LogprobDispatchError) as err:
        kernels.get_logprob_op(contract(), "cuda_only")
    assert err.value.rejections == {"cuda_only": ["platform 'cpu' unsupported (declared for cuda)"]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # dispatch only asks; nothing runs here
    assert kernels.get_logprob_op(contract(platform="cuda"), "cuda_only").backend_id == "cuda_only"
    with pytest.raises(
        kernels.LogprobDispatchError,
        match=re.escape(f"nonesuch: not registered (registered backends: {', '.join(kernels.BACKENDS)})"),
    ):
        kernels.get_logprob_op(contract(), "nonesuch")


def test_re_registering_an_id_is_refused_unless_replaced_in_place():
    order = list(kernels.BACKENDS)
    with pytest.raises(kernels.LogprobContractError, match=r"'aten' is already registered; pass replace=True"):
        register("aten", permissive(tp_sizes={1}))
    assert kernels.registered_backends()["aten"].tp_sizes is None
    register("aten", permissive(tp_sizes={1}), replace=True)
    assert kernels.registered_backends()["aten"].tp_sizes == {1}
    assert list(kernels.BACKENDS) == order  # a replacement keeps its place in the order auto tries


def test_a_cuda_contract_on_a_machine_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a CPU-only machine reports
    with pytest.raises(kernels.LogprobDispatchError, match=r"triton: platform 'cuda' is unavailable"):
        kernels.get_logprob_op(contract(platform="cuda"), "triton")


def test_a_split_lm_head_logprob_does_not_run_is_refused(fake):
    fake(permissive())
    even = contract()
    lo, hi = even.sharding.bounds[0]
    uneven = replace(even.sharding, bounds=((lo, hi + TILE), (hi + TILE, even.sharding.padded_vocab_size)))
    with pytest.raises(kernels.LogprobDispatchError, match=re.escape(f"sharding bounds {uneven.bounds}")):
        kernels.get_logprob_op(replace(even, sharding=uneven), "fake")


@pytest.mark.parametrize(
    ("backend_id", "value"), [("auto", "'auto'"), ("explicit", "'explicit'"), (" aten", "' aten'"), ("", "''")]
)
def test_registration_refuses_ids_that_are_policies_or_blank(backend_id, value):
    before = dict(kernels.BACKENDS)
    with pytest.raises(kernels.LogprobContractError, match=re.escape(value)):
        register(backend_id, permissive())
    assert kernels.BACKENDS == before


def test_registration_refuses_unknown_platforms_and_tp_modes_and_non_capabilities():
    with pytest.raises(
        kernels.LogprobContractError, match=r"capability\.platforms must be one of cpu, cuda; got 'rocm'"
    ):
        permissive(platforms={"rocm"})
    with pytest.raises(kernels.LogprobContractError, match=r"capability\.tp_modes must be .*; got 'threads'"):
        permissive(tp_modes={"threads"})
    with pytest.raises(kernels.LogprobContractError, match=r"capability\.platforms must name at least one"):
        permissive(platforms=set())
    with pytest.raises(kernels.LogprobContractError, match="'rocm'"):
        kernels.registered_backends("rocm")
    with pytest.raises(kernels.LogprobContractError, match=r"capability must be .*\{'dtypes'"):
        register("fake", {"dtypes": ["float32"]})
    assert "fake" not in kernels.BACKENDS
    with pytest.raises(kernels.LogprobContractError, match="'nonesuch' is not registered"):
        kernels.unregister_backend("nonesuch")
    with pytest.raises(kernels.LogprobContractError, match=r"backend \['aten'\] is not registered"):
        kernels.unregister_backend(["aten"])  # an unhashable id: no bare TypeError


def test_unregistering_returns_the_instance_and_removes_every_declaration():
    aten = kernels.BACKENDS["aten"]
    assert kernels.unregister_backend("aten") is aten
    assert "aten" not in kernels.registered_backends() and "aten" not in kernels.BACKENDS
    with pytest.raises(kernels.LogprobDispatchError, match=r"aten: not registered"):
        kernels.get_logprob_op(contract(**FIXED), "aten")


def test_builtin_capabilities_are_truthful():
    assert kernels.get_logprob_op(contract(tp=4), "triton").backend_id == "triton"
    with pytest.raises(
        kernels.LogprobDispatchError, match=f"aten: determinism scope '{SCOPE.CROSS_TP_BITWISE.value}' not guaranteed"
    ):
        kernels.get_logprob_op(contract(), "aten")
    with pytest.raises(
        kernels.LogprobDispatchError, match=f"control: determinism scope '{SCOPE.CROSS_TP_BITWISE.value}' not"
    ):
        kernels.get_logprob_op(contract(), "control")
    with pytest.raises(kernels.LogprobDispatchError, match=r"reference: .*output dtype 'float32' unsupported"):
        kernels.get_logprob_op(contract(**FIXED), "reference")
    float64_out = contract(**FIXED, partial_dtype=torch.float64, output=kernels.LogprobOutputSpec(dtype="float64"))
    assert kernels.get_logprob_op(float64_out, "reference").backend_id == "reference"


def test_control_runs_when_named_and_never_under_auto():
    op = kernels.get_logprob_op(contract(tp=1, **FIXED), "control")
    result = op(*inputs())
    assert result.provenance.nodes["logprob"].backend == "control"
    assert kernels.resolve_logprob_backend(contract(tp=1, **FIXED), "auto") == "aten"
    kernels.unregister_backend("aten")
    with pytest.raises(
        kernels.LogprobDispatchError,
        match=f"control: implementation kind '{kernels.ImplementationKind.NEGATIVE_CONTROL.value}' is only run",
    ):
        kernels.get_logprob_op(contract(tp=1, **FIXED), "auto")


def test_auto_failure_lists_every_candidate_with_its_reasons():
    register("cuda_only", permissive(platforms={"cuda"}))
    wanted = contract(tp=1, output=kernels.LogprobOutputSpec(dtype="float64"))
    with pytest.raises(kernels.LogprobDispatchError) as err:
        kernels.get_logprob_op(wanted, "auto")
    assert list(err.value.rejections) == [*kernels.registered_backends("cpu"), "cuda_only"]
    assert list(err.value.rejections) == list(kernels.registered_backends())  # registration order
    assert all(err.value.rejections.values())
    assert "output dtype 'float64' unsupported" in "; ".join(err.value.rejections["triton"])
    assert "platform 'cpu' unsupported (declared for cuda)" in err.value.rejections["cuda_only"]


def test_a_backend_without_distributed_ranks_is_refused_for_tp_mode_distributed(fake):
    fake(permissive(tp_modes={"emulated"}))
    with pytest.raises(kernels.LogprobDispatchError, match=re.escape("tp_mode=distributed")) as err:
        kernels.get_logprob_op(contract(), "fake", tp_mode="distributed")
    assert err.value.rejections == {"fake": ["tp_mode 'distributed' unsupported (supports emulated)"]}
    assert kernels.get_logprob_op(contract(), "fake").tp_mode == "emulated"
    with pytest.raises(kernels.LogprobDispatchError, match=re.escape("'distributed' unsupported")):
        kernels.resolve_logprob_backend(contract(), "fake", tp_mode="distributed")


def test_the_op_is_bound_to_its_tp_mode_and_records_it():
    for tp_mode in kernels.TP_MODES:
        op = kernels.get_logprob_op(contract(**FIXED), "aten", tp_mode=tp_mode)
        assert (op.tp_mode, op.to_dict()["tp_mode"]) == (tp_mode, tp_mode)
    assert kernels.get_logprob_op(contract(**FIXED), "aten").to_dict()["tp_mode"] == "emulated"
    with pytest.raises(kernels.LogprobContractError, match=r"tp_mode must be one of emulated, distributed; got 'x'"):
        kernels.get_logprob_op(contract(**FIXED), "aten", tp_mode="x")


@pytest.mark.parametrize("given", [None, {"vocab_size": VOCAB}, "contract"])
def test_a_contract_that_is_no_logprob_contract_is_refused_by_name(given):
    for dispatch in (kernels.get_logprob_op, kernels.resolve_logprob_backend):
        with pytest.raises(kernels.LogprobContractError, match=rf"contract must be a LogprobContract; got {given!r}"):
            dispatch(given, "auto")


def test_auto_is_refused_for_tp_above_one_without_a_rank_agreement():
    with pytest.raises(kernels.LogprobDispatchError, match="requested_backend='auto' is refused for tp=2"):
        kernels.get_logprob_op(contract(tp=2), "auto")
    assert kernels.get_logprob_op(contract(tp=1), "auto").backend_id == "triton"


def test_auto_with_a_checked_rank_agreement_binds_the_agreed_backend():
    per_rank = [contract(tp=2, rank=r) for r in range(2)]
    gathered = {(c.cross_rank_fingerprint(), kernels.resolve_logprob_backend(c, "auto")) for c in per_rank}
    assert len(gathered) == 1
    agreement = kernels.RankAgreement(*gathered.pop())
    op = kernels.get_logprob_op(per_rank[1], "auto", agreement=agreement)
    assert (op.backend_id, op.policy) == ("triton", kernels.DispatchPolicy.AUTO)


def test_a_rank_agreement_that_does_not_hold_is_refused():
    wanted = contract(tp=2)
    other = contract(tp=2, dtype=torch.bfloat16).cross_rank_fingerprint()
    with pytest.raises(kernels.LogprobDispatchError, match=f"fingerprint '{other}'"):
        kernels.get_logprob_op(wanted, "auto", agreement=kernels.RankAgreement(other, "triton"))
    agreed_aten = kernels.RankAgreement(wanted.cross_rank_fingerprint(), "aten")
    with pytest.raises(kernels.LogprobDispatchError, match="agreed on backend 'aten', but this rank resolved 'triton'"):
        kernels.get_logprob_op(wanted, "auto", agreement=agreed_aten)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_op_runs_lm_head_logprob_and_checks_what_ran(tp):
    hidden, weight, targets = inputs()
    result = kernels.get_logprob_op(contract(tp=tp, **FIXED), "aten")(hidden, weight, targets)
    direct = kernels.lm_head_logprob(hidden, weight, targets, backend="aten", tp=tp, vocab_tile=TILE)
    assert kernels.first_bit_difference(result.logp, direct.logp) is None
    assert kernels.first_bit_difference(result.lse, direct.lse) is None
    assert {n.backend for n in result.provenance.nodes.values()} == {"aten"}
    assert result.provenance.tp == tp


def test_an_op_whose_backend_left_the_registry_or_its_contract_since_binding_refuses_to_run(fake):
    """The op re-reads the registry before it runs: a backend unregistered since, or replaced under a capability
    that no longer honours the op's contract, is refused rather than run under a claim nobody makes."""
    fake(permissive())
    op = kernels.get_logprob_op(contract(), "fake")  # cross_tp_bitwise, global_tile
    hidden, weight, targets = inputs()
    op(hidden, weight, targets)
    register("fake", permissive(determinism_scopes={"fixed_topology"}, merge_orders={"rank_shard"}), replace=True)
    with pytest.raises(kernels.LogprobDispatchError, match=r"registry changed since it was bound") as err:
        op(hidden, weight, targets)
    assert err.value.rejections["fake"][0].startswith("determinism scope 'cross_tp_bitwise' not guaranteed")
    kernels.unregister_backend("fake")
    with pytest.raises(kernels.LogprobDispatchError, match=r"fake: not registered"):
        op(hidden, weight, targets)
    register("fake", permissive())  # a new declaration that honours the contract: the op runs again
    op(hidden, weight, targets)


def test_the_op_refuses_inputs_outside_its_contract():
    op = kernels.get_logprob_op(contract(**FIXED), "aten")
    hidden, weight, targets = inputs()
    with pytest.raises(kernels.DtypeMismatchError, match=re.escape("torch.bfloat16")):
        op(hidden.bfloat16(), weight.bfloat16(), targets)
    with pytest.raises(kernels.ShapeMismatchError, match=rf"V={VOCAB}.*\(150, 8\)"):
        op(hidden, weight[:150], targets.clamp(max=149))


def test_a_fake_triton_running_aten_code_is_caught_by_the_provenance_comparison(monkeypatch):
    aten = kernels.BACKENDS["aten"]

    class AtenDressedAsTriton:
        id = "triton"
        capability = kernels.BACKENDS["triton"].capability  # what dispatch reads: triton's claims

        def __getattr__(self, name):
            return getattr(aten, name)

    monkeypatch.setitem(kernels.BACKENDS, "triton", AtenDressedAsTriton())
    op = kernels.get_logprob_op(contract(tp=2), "triton")
    with pytest.raises(
        kernels.ProvenanceMismatchError, match="node 'matmul': required backend 'triton', observed 'aten'"
    ) as err:
        op(*inputs())
    assert len(err.value.mismatches) == len(kernels.OP_NODES)
    assert {n.backend for n in err.value.observed.nodes.values()} == {"aten"}
    # The orchestrator's own comparison, against a profile's required nodes, sees the same thing.
    result = kernels.lm_head_logprob(*inputs(), backend="triton", tp=2, vocab_tile=TILE)
    with pytest.raises(kernels.ProvenanceMismatchError, match="node 'tp_merge': required backend 'triton'"):
        kernels.require_provenance(dict.fromkeys(kernels.OP_NODES, "triton"), result.provenance)


def test_every_observed_difference_is_reported():
    op = kernels.get_logprob_op(contract(**FIXED), "aten")
    result = op(*inputs())
    nodes = dict(result.provenance.nodes)
    nodes["matmul"] = replace(nodes["matmul"], device="cuda:0 (NVIDIA H200)")
    del nodes["tp_merge"]
    forged = replace(
        result,
        logp=result.logp.double(),
        provenance=replace(result.provenance, nodes=nodes, tp=1, tp_mode="distributed"),
    )
    problems = op.observed_mismatches(forged)
    assert problems == [
        "node 'tp_merge': required backend 'aten', observed nothing (the node did not run)",
        "tp: required 2, observed 1",
        "tp_mode: required 'emulated', observed 'distributed'",
        "logp dtype: required 'float32', observed 'float64'",
        "node 'matmul': required platform 'cpu', observed device 'cuda:0 (NVIDIA H200)'",
    ]
    with pytest.raises(kernels.ProvenanceMismatchError, match="tp: required 2, observed 1"):
        op.require_observed(forged)


@pytest.mark.interpreter
def test_the_triton_op_passes_its_own_provenance_check_at_tp_2():
    hidden, weight, targets = inputs(rows=2, hidden=16, vocab=40)
    wanted = kernels.LogprobContract.even(40, TILE, 2, dtype=torch.float32, platform="cpu")
    result = kernels.get_logprob_op(wanted, "triton")(hidden, weight, targets)
    launched = {name: set(node.kernels) for name, node in result.provenance.nodes.items()}
    declared = kernels.BACKENDS["triton"].declared_kernels
    assert launched.keys() == declared.keys()
    assert all(launched[node] and launched[node] <= declared[node] for node in declared), (launched, declared)
