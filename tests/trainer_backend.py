"""Two backends written from docs/extending.md's trainer recipe alone: a trainer's fp32 log_softmax then gather, and
the same function under torch.compile(dynamic=True)."""

import functools

import torch

import kernels
from kernels.backend import STOCK_MATMUL_OPS

REDUCES = frozenset({"aten::log_softmax", "aten::logsumexp"})
COMPILED = frozenset({"torch.compile::graph"})
CAPABILITY = kernels.LogprobBackendCapability(
    implementation_kind=kernels.ImplementationKind.PRODUCTION,
    dtypes=frozenset(kernels.EXECUTION_DTYPE_NAMES),
    determinism_scopes=frozenset({kernels.DeterminismScope.FIXED_TOPOLOGY}),
    merge_orders=frozenset({kernels.MergeOrder.RANK_SHARD}),
)


def log_softmax_gather(logits, targets):
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, torch.logsumexp(logits, dim=-1)


@kernels.register_backend(
    "my_trainer", kernels={"matmul": STOCK_MATMUL_OPS, "logprob": REDUCES, "tp_merge": REDUCES}, capability=CAPABILITY
)
class MyTrainer:
    id: str

    def logits_logprob(self, logits, targets):
        return log_softmax_gather(logits, targets)


@kernels.register_backend(
    "my_trainer_compiled",
    kernels={"matmul": STOCK_MATMUL_OPS, "logprob": COMPILED, "tp_merge": COMPILED},
    capability=CAPABILITY,
)
class MyCompiledTrainer:
    id: str

    @functools.cached_property
    def compiled(self):  # at the first call: torch.compile imports triton, which must not happen at import
        return torch.compile(log_softmax_gather, dynamic=True)

    def logits_logprob(self, logits, targets):
        return self.compiled(logits, targets)
