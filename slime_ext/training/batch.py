"""One micro-batch as tensors: its samples packed into a single row with a block-diagonal causal mask.

Megatron's local attention (``DotProductAttention``) has no packed-sequence (THD) support, so samples are packed
along the sequence and kept apart by the mask: token ``j`` of sample ``a`` attends to token ``k`` only if ``k`` is
in ``a`` and ``k <= j``. Position ids restart at 0 for every sample, so each sample sees exactly what it would see
alone. The row is as long as the micro-batch's tokens (no padding); under pipeline parallelism Megatron exchanges
the shape per micro-batch (``variable_seq_lengths``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the fields a micro-batch needs (``DataIterator.get_next`` keys)
BATCH_KEYS = ("tokens", "total_lengths", "response_lengths", "loss_masks", "advantages", "sample_indices")


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    attention_mask: torch.Tensor  # [1, 1, T, T] bool, True = masked
    #: per response token (concatenated over samples): the logit position that predicts it, its id, its mask
    #: and its sample's advantage
    logit_positions: torch.Tensor  # [R] int64
    targets: torch.Tensor  # [R] int64
    loss_mask: torch.Tensor  # [R] float32
    advantages: torch.Tensor  # [R] float32
    response_lengths: list[int]
    sample_ids: list[int] | None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def block_causal_mask(lengths: list[int]) -> torch.Tensor:
    """``[1, 1, T, T]`` bool mask (True = masked) that keeps each sample causal and on its own."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(len(seg))
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def pack_micro_batch(batch: dict, *, max_positions: int | None = None, device: torch.device | str = "cpu"
                     ) -> PackedBatch:
    """Pack ``DataIterator.get_next(BATCH_KEYS)`` output into tensors on ``device``."""
    tokens, totals = batch["tokens"], batch["total_lengths"]
    responses, masks, advantages = batch["response_lengths"], batch["loss_masks"], batch["advantages"]
    if not tokens:
        raise ValueError("an empty micro-batch reached the model; the schedule must not contain empty micro-batches")
    flat, positions, logit_pos, targets, mask, adv = [], [], [], [], [], []
    offset = 0
    for i, (toks, total, resp) in enumerate(zip(tokens, totals, responses)):
        if len(toks) != total or not 0 < resp < total or len(masks[i]) != resp:
            raise ValueError(f"sample {i} of the micro-batch: tokens/total_length/response_length/loss_mask "
                             f"disagree ({len(toks)}, {total}, {resp}, {len(masks[i])})")
        if max_positions is not None and total > max_positions:
            raise ValueError(f"a sample has total_length={total} > max_position_embeddings={max_positions}; raise "
                             f"--seq-length/--max-position-embeddings or truncate the rollout")
        flat.extend(toks)
        positions.extend(range(total))
        first = offset + total - resp  # first response token in the packed row
        logit_pos.extend(range(first - 1, offset + total - 1))
        targets.extend(toks[total - resp:])
        mask.extend(masks[i])
        adv.extend([float(advantages[i])] * resp)
        offset += total
    return PackedBatch(
        tokens=torch.tensor(flat, dtype=torch.int64, device=device)[None],
        position_ids=torch.tensor(positions, dtype=torch.int64, device=device)[None],
        attention_mask=block_causal_mask(list(totals)).to(device),
        logit_positions=torch.tensor(logit_pos, dtype=torch.int64, device=device),
        targets=torch.tensor(targets, dtype=torch.int64, device=device),
        loss_mask=torch.tensor(mask, dtype=torch.float32, device=device),
        advantages=torch.tensor(adv, dtype=torch.float32, device=device),
        response_lengths=list(responses),
        sample_ids=None if batch.get("sample_indices") is None else list(batch["sample_indices"]),
    )
