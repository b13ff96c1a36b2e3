"""Liger-Kernel's fused head (the built-in ``liger`` backend) with the bugs a training stack really ships: each is
registered with liger's own declarations and capability, so only its values can give it away."""

import torch

import kernels
from kernels.stacks import LIGER_CAPABILITY, LIGER_KERNELS, liger_function
from kernels.validation import IGNORE_INDEX

DECLARED = dict.fromkeys(kernels.OP_NODES, LIGER_KERNELS)


def liger_loss(hidden, weight, targets, *, z_loss_scale=0.0):
    return liger_function().apply(hidden, weight, targets, None, None, IGNORE_INDEX, z_loss_scale, 0.0, "none")[0]


@kernels.register_backend("liger_z_loss", kernels=DECLARED, capability=LIGER_CAPABILITY)
class LeakedZLoss:
    """The z-loss regulariser (1e-4 * lse**2, a common setting) left on when the loss is read as -logp."""

    def head_logprob(self, hidden, weight, targets):
        return -liger_loss(hidden, weight, targets, z_loss_scale=1e-4)


@kernels.register_backend("liger_temperature", kernels=DECLARED, capability=LIGER_CAPABILITY)
class HairWideTemperature:
    """Sampling temperature 1.01 applied to the trainer's logits (by scaling the head), not only to the rollout's."""

    def head_logprob(self, hidden, weight, targets):
        return -liger_loss(hidden, weight / 1.01, targets)


@kernels.register_backend("liger_last_row", kernels=DECLARED, capability=LIGER_CAPABILITY)
class DroppedLastRow:
    """A chunk loop that stops one row short: the call's last row keeps the loss buffer's initial 0."""

    def head_logprob(self, hidden, weight, targets):
        loss = liger_loss(hidden[:-1], weight, targets[:-1])
        return -torch.cat([loss, loss.new_zeros(1)])
