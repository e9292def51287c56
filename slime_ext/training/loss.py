"""The per-token policy-gradient loss and how it is scaled for Megatron.

Per step ``s`` the objective is

    L_s = sum over every loss token t of the step, on every DP rank, of  -advantage(t) * log p(t)
          -----------------------------------------------------------------------------------------
                         loss_tokens_per_step[s]   (all loss-mask tokens of the step, all ranks)

so it does not depend on how the samples were split into ranks and micro-batches. Megatron divides each
micro-batch's loss by ``num_microbatches`` (the two-value loss-function contract) and DDP averages gradients over
the ``dp_size`` ranks; the local sum is multiplied by ``num_microbatches * dp_size / loss_tokens_per_step[s]`` to
undo both.
"""

from __future__ import annotations

import torch

from .batch import PackedBatch


def token_log_probs(logits: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """``log p(response token)`` for every response token of the packed micro-batch (``[R]``, fp32)."""
    picked = logits[0, packed.logit_positions].float()  # [R, vocab]
    return torch.log_softmax(picked, dim=-1).gather(-1, packed.targets[:, None]).squeeze(-1)


def policy_loss_sum(logits: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """``sum(-advantage * log p * loss_mask)`` over the micro-batch (unnormalised)."""
    return -(packed.advantages * token_log_probs(logits, packed) * packed.loss_mask).sum()


def loss_scale(num_microbatches: int, dp_size: int, step_loss_tokens: int) -> float:
    """Factor that turns a micro-batch's loss sum into Megatron's per-micro-batch loss (see module docstring).

    A step without any loss token trains nothing (scale 0) instead of dividing by zero.
    """
    if step_loss_tokens <= 0:
        return 0.0
    return num_microbatches * dp_size / step_loss_tokens


def train_loss_func(packed: PackedBatch, output_tensor: torch.Tensor, *, scale: float):
    """Megatron loss function (two-value contract): ``(scaled loss, {"loss_sum", "loss_tokens"})``."""
    loss_sum = policy_loss_sum(output_tensor, packed)
    stats = {"loss_sum": loss_sum.detach().clone(),
             "loss_tokens": torch.tensor(float(packed.num_loss_tokens))}
    return loss_sum * scale, stats


def log_prob_func(packed: PackedBatch, output_tensor: torch.Tensor):
    """Megatron loss function for forward-only passes: a zero loss and the per-token log-probs."""
    log_probs = token_log_probs(output_tensor, packed).detach()
    return torch.zeros((), dtype=log_probs.dtype, device=log_probs.device), {
        "log_probs": log_probs, "response_lengths": packed.response_lengths}
