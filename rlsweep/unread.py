"""Keys a run's chosen options leave unread: refused where the user set them, ignored where the shipped configs did.

``model.weights.seed`` makes synthetic weights only: with ``model.weights.kind=file`` nothing reads it, so a sweep over
it would run one job several times and call the copies a sweep. Set on the command line or in the user's own config,
such a key is refused by name with what would read it; left as a shipped option file or the schema gives it (the
``seed: 8`` of ``model=qwen3_8b``, whose weights a file then replaces), it is ignored. Which keys the user set is the
config layer's knowledge (``rlsweep.config.user_set_keys``); this module knows which keys each choice leaves unread.
docs/index.md (Input bounds) lists the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from rlsweep.errors import ConfigError
from rlsweep.spec import CHUNKED_CELLS, NEEDLE

ABSENT = object()  # a key the config does not hold


def value_at(config: Mapping[str, Any], key: str) -> Any:
    """The value of a dotted ``key`` (``model.weights.seed``) in nested mappings, or ``ABSENT``."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ABSENT
        node = node[part]
    return node


@dataclass(frozen=True)
class UnreadRule:
    """``keys`` go unread whenever ``why`` gives a reason for the config at hand (else None); ``instead`` says what
    would read them."""

    keys: tuple[str, ...]
    why: Callable[[Mapping[str, Any]], str | None]
    instead: str


def weights(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config["model"].get("weights", {})


def cells(config: Mapping[str, Any]) -> list[str]:
    return list(config["layout"].get("cells", []))


def synthetic_weights(config: Mapping[str, Any]) -> str | None:
    if weights(config).get("kind") != "synthetic":
        return None
    return "applies to weight files only, and model.weights.kind=synthetic reads none (its weight comes from "\
        "model.weights.seed, with model.vocab_size rows)"  # fmt: skip


def file_weights(config: Mapping[str, Any]) -> str | None:
    if weights(config).get("kind") != "file":
        return None
    return (
        f"makes synthetic weights only, and model.weights.kind=file reads the head from model.weights.path "
        f"({weights(config).get('path')!r})"
    )


def replayed_workload(config: Mapping[str, Any]) -> str | None:
    workload = config["workload"]
    if workload.get("source") != "replay":
        return None
    return (
        f"applies to synthetic workloads only; workload {workload.get('name')!r} replays {workload.get('path')!r}, "
        "whose file gives them"
    )


def synthetic_workload(config: Mapping[str, Any]) -> str | None:
    workload = config["workload"]
    if workload.get("source") != "synthetic":
        return None
    return f"applies to replay workloads only, and workload {workload.get('name')!r} is synthetic: it reads no file"


def no_chunked_cell(config: Mapping[str, Any]) -> str | None:
    if any(cell in CHUNKED_CELLS for cell in cells(config)):
        return None
    return f"applies to the chunked cells only ({', '.join(CHUNKED_CELLS)}), and layout.cells {cells(config)} has none"


def no_needle_cell(config: Mapping[str, Any]) -> str | None:
    if NEEDLE in cells(config):
        return None
    return f"are read by no cell: layout.cells {cells(config)} has no {NEEDLE!r}"


def whole_model(config: Mapping[str, Any]) -> str | None:
    if config["model"].get("body") is None:
        return None
    return (
        f"applies to the head alone, and model {config['model'].get('name')!r} is a whole model: its head is its "
        "lm_head and its hidden states are its body's, on token workloads"
    )


def head_alone(config: Mapping[str, Any]) -> str | None:
    if config["model"].get("body") is not None:
        return None
    return f"applies to whole models only, and model {config['model'].get('name')!r} is a head alone (no model.body)"


def nothing_seeded(config: Mapping[str, Any]) -> str | None:
    """The run seed draws a synthetic workload, the needle cells' filler rows and grad=true's upstream gradients (a
    whole model's needles are the workload's own sequences)."""
    workload = config["workload"]
    fillers = NEEDLE in cells(config) and config["model"].get("body") is None
    if workload.get("source") != "replay" or fillers or config.get("grad"):
        return None
    return (
        f"seeds synthetic workloads, needle cells and grad=true only, and this run has none: workload "
        f"{workload.get('name')!r} replays a file, layout.cells {cells(config)} has no {NEEDLE!r} and grad=false"
    )


RULES = (
    UnreadRule(("model.weights.path", "model.weights.tensor"), synthetic_weights,
               "set model.weights.kind=file to test the file"),
    UnreadRule(("model.padded_vocab_size", "model.tie_word_embeddings"), synthetic_weights,
               "set model.weights.kind=file model.weights.path=... to test a checkpoint's head they describe"),
    UnreadRule(("model.weights.seed", "model.weights.logit_std"), file_weights,
               "set model.weights.kind=synthetic to test synthetic weights"),
    UnreadRule(("workload.hidden_scale", "workload.seq_lens", "workload.prompt_lens", "workload.sample_scales",
                "workload.probe_samples"), replayed_workload, "choose a synthetic workload (workload=varlen4, say)"),
    UnreadRule(("workload.path",), synthetic_workload, "use workload=replay to replay the file"),
    UnreadRule(("layout.chunk_size",), no_chunked_cell, f"add {' or '.join(CHUNKED_CELLS)} to layout.cells"),
    UnreadRule(("layout.needles",), no_needle_cell, f"add {NEEDLE!r} to layout.cells"),
    UnreadRule(("model.weights.kind", "model.weights.seed", "model.weights.logit_std", "model.weights.path",
                "model.weights.tensor", "model.padded_vocab_size", "model.tie_word_embeddings",
                "workload.hidden_scale", "workload.sample_scales", "workload.probe_samples"), whole_model,
               "choose a head model (model=tiny, say) to sweep the head alone"),
    UnreadRule(("profile.body_attention", "profile.body_packing"), head_alone,
               "choose a whole model (model=qwen3_tiny, say)"),
    UnreadRule(("seed",), nothing_seeded, f"add a {NEEDLE!r} cell or grad=true, or choose a synthetic workload"),
)  # fmt: skip
CONDITIONAL_KEYS = tuple(key for rule in RULES for key in rule.keys)  # every key some choice leaves unread


def refuse_unread(config: Mapping[str, Any], user_set: Collection[str]) -> None:
    """Refuse, by name, every key of ``user_set`` (those the user set: ``rlsweep.config.user_set_keys``) that the
    resolved ``config``'s choices leave unread; the same keys as the shipped configs set them are ignored."""
    for rule in RULES:
        set_here = [key for key in rule.keys if key in user_set]
        reason = rule.why(config) if set_here else None
        if reason:
            key = set_here[0]
            raise ConfigError(f"{key}={value_at(config, key)!r} {reason}: leave {key} unset, or {rule.instead}")
